# SPDX-License-Identifier: Apache-2.0
"""Fuzzing every binary port the plugin listens on, in process (issue 18): strangers and token holders
send garbage, truncated, oversized and mutated frames; no server stops serving.

Each port gets a few hundred frames here (`benchmarks/chaos.py --fuzz-frames` sends 10,000+ per port
to a real deployment's processes). Real servers, real sockets, real handshakes."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from vllm_disagg.attention.client import DisaggAttentionClient
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.config import KVTransferSection
from vllm_disagg.errors import DisaggError
from vllm_disagg.kv.handshake import HandshakeInfo, MsgType, SideMsg, decode_msg, encode_msg
from vllm_disagg.kv.push_receiver import PushReceiver
from vllm_disagg.kv.push_sender import PushSender
from vllm_disagg.kv.side_channel import SideChannelClient
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.testing.fuzz import (
    FuzzTarget,
    attention_seeds,
    fuzz_port,
    kv_write_seeds,
    side_channel_seeds,
)
from vllm_disagg.transport import TransportOptions, get_transport
from vllm_disagg.transport import server as auth_server

TOKEN = "fuzz-token"
FRAMES = int(os.environ.get("VD_FUZZ_FRAMES", "400"))
INFO = HandshakeInfo(model="m", dtype="float32", block_size=16, kv_layout="cpu:float32(2, 16, 8)",
                     num_layers=2, num_kv_heads=2, head_size=4, block_nbytes=1024)


def _tcp():
    return get_transport("tcp", TransportOptions(auth_token=TOKEN, timeout_s=2.0))


@pytest.fixture
def thread_errors():
    """Exceptions that escaped a server thread (the fuzz must provoke none)."""
    seen, old = [], threading.excepthook
    threading.excepthook = lambda args: seen.append(f"{args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")
    yield seen
    threading.excepthook = old


def _check(result, thread_errors):
    print(result.as_dict())
    assert result.num_frames >= FRAMES and result.num_pre_auth and result.num_post_auth
    assert result.server_crashes_from_bad_input == 0, result.first_failure
    assert not thread_errors, thread_errors[:3]


def test_the_kv_side_channel_survives_fuzzing(thread_errors):
    cfg = KVTransferSection(push_timeout_s=1.0)
    sender = PushSender(_tcp(), _tcp(), INFO, TOKEN, [torch.zeros(8, 1024 // 4)] * 2, cfg,
                        (DisaggKVConnectorStats(), threading.Lock()))
    client = SideChannelClient(lambda addr, timeout: _tcp().connect_msg(addr, timeout=timeout))

    def probe() -> bool:
        reply = client.call(sender.address, encode_msg(SideMsg(MsgType.CANCEL, {"transfer_id": "probe"})), 5.0)
        return decode_msg(reply).type is MsgType.CANCEL_ACK

    try:
        target = FuzzTarget("kv-side-channel", sender.address, b"msg", TOKEN, side_channel_seeds(), probe)
        _check(fuzz_port(target, FRAMES, seed=1, check_every=100), thread_errors)
    finally:
        client.close()
        sender.close()


def test_the_kv_receiver_survives_fuzzing(thread_errors):
    layers = [torch.zeros(8, 2, 16, 8) for _ in range(2)]
    receiver = PushReceiver(_tcp(), _tcp(), INFO, TOKEN, layers, (DisaggKVConnectorStats(), threading.Lock()))
    try:
        target = FuzzTarget("kv-receiver", receiver.address, b"kv", TOKEN, kv_write_seeds())
        _check(fuzz_port(target, FRAMES, seed=2, check_every=100), thread_errors)
    finally:
        receiver.close()


def test_the_attention_server_s_ports_survive_fuzzing(thread_errors):
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN, kv_transport="tcp")
    info = srv.start()
    ping = _tcp()

    def probe() -> bool:
        from vllm_disagg.attention import wire

        ch = ping.connect_msg(info["address"], timeout=5)
        try:
            ch.send(wire.Header(wire.PING, seq=1).pack(), [])
            return wire.unpack_header(ch.recv(timeout=5).header).mtype is wire.PONG
        finally:
            ch.close()

    try:
        client = DisaggAttentionClient([info["http"]], transport="tcp", send_q_early=False, auth_token=TOKEN)
        client.connect(2, 4, 2, 32, 16, "float32", 64)  # the KV ingest port opens with the first INIT
        ingest = FuzzTarget("attention-kv-ingest", srv.info()["kv_address"], b"kv", TOKEN, kv_write_seeds())
        _check(fuzz_port(ingest, FRAMES, seed=4, check_every=100), thread_errors)
        msg = FuzzTarget("attention-msg", info["address"], b"msg", TOKEN, attention_seeds(), probe)
        _check(fuzz_port(msg, FRAMES, seed=3, check_every=100), thread_errors)
        client.close()
    finally:
        srv.stop()


def test_silent_strangers_cannot_pile_up_and_a_real_client_still_gets_in():
    """Slowloris on a binary port: handshakes past the bound are closed at once (no thread each);
    once the silent ones time out or leave, an honest client is served."""
    listener = _tcp().listen_msg()
    host, port = listener.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(auth_server.MAX_PENDING_HANDSHAKES)]
    try:
        extra = socket.create_connection((host, int(port)), timeout=5)
        extra.settimeout(5)
        assert extra.recv(64) == b""  # closed by the server without a CHALLENGE
        extra.close()
    finally:
        for sock in silent:
            sock.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            _tcp().connect_msg(listener.address, timeout=2).close()
            break
        except DisaggError:
            assert time.monotonic() < deadline
    listener.close()
