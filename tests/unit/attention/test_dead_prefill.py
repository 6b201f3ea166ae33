# SPDX-License-Identifier: Apache-2.0
"""Prefill -> attention-server pushes: a prefill process SIGKILLed after it accepted the decode side's
registration is noticed through its side channel's EOF within a poll or two, not at push_timeout_s.

Real parts on 127.0.0.1: the prefill side's `PushSender` in its own process, an attention server with
its KV receiver (`--kv-transport tcp`) that a real client INITed, and the decode side's
`AttnPushReceiver` doing the registration."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
import torch

from vllm_disagg.attention.client import DisaggAttentionClient
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.config import RemoteAttentionSection
from vllm_disagg.kv.handshake import HandshakeInfo
from vllm_disagg.kv.lamina.targets import AttnPushReceiver
from vllm_disagg.kv.metadata import RecvSpec
from vllm_disagg.kv.push_receiver import RecvState
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.testing.sender_process import start_sender_process
from vllm_disagg.transport import TransportOptions, get_transport

TOKEN = "dead-prefill-token"
BS, LAYERS, KV_HEADS, HEAD = 32, 2, 2, 32
INFO = HandshakeInfo(model="m", dtype="float32", block_size=BS, kv_layout=f"cpu:float32({KV_HEADS}, {BS}, {2 * HEAD})",
                     num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD,
                     block_nbytes=KV_HEADS * BS * 2 * HEAD * 4)
PUSH_TIMEOUT_S = 30.0


def _sender_and_receiver(http: str, client, **kv) -> tuple:
    """A prefill-side PushSender in this process and the model worker's AttnPushReceiver for the
    attention server at `http` (head-wise, tcp), as the tests here pair them."""
    from vllm_disagg.config import KVTransferSection
    from vllm_disagg.kv.push_sender import PushSender

    tp = lambda: get_transport("tcp", TransportOptions(auth_token=TOKEN))  # noqa: E731
    layers = [torch.randn(8, KV_HEADS, BS, 2 * HEAD) for _ in range(LAYERS)]
    sender = PushSender(tp(), tp(), INFO, TOKEN, layers, KVTransferSection(push_timeout_s=PUSH_TIMEOUT_S, **kv),
                        (DisaggKVConnectorStats(), threading.Lock()))
    ra = RemoteAttentionSection(servers=[http], transport="tcp", partition="head")
    receiver = AttnPushReceiver(tp(), INFO, TOKEN, (DisaggKVConnectorStats(), threading.Lock()), "recompute", ra,
                                client=lambda: client)
    return sender, receiver


@pytest.fixture
def attention_server():
    server = DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN, kv_transport="tcp")
    info = server.start()
    client = DisaggAttentionClient([info["http"]], transport="tcp", auth_token=TOKEN)
    client.connect(num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS, head_size=HEAD, block_size=BS,
                   dtype="float32", max_num_tokens=256)  # the INIT attaches the server's KV receiver
    yield info["http"], client
    client.close()
    server.stop()


def _start_prefill() -> tuple[subprocess.Popen, str]:
    return start_sender_process(INFO, TOKEN, (8, KV_HEADS, BS, 2 * HEAD), PUSH_TIMEOUT_S)


def _poll_until(receiver: AttnPushReceiver, req_id: str, timeout_s: float) -> tuple[set, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        done, failed = receiver.poll()
        if req_id in done:
            return failed, time.monotonic() - t0
        time.sleep(0.01)
    return set(), timeout_s


def _state(receiver: AttnPushReceiver, req_id: str) -> str | None:
    with receiver._lock:
        recv = receiver._recvs.get(req_id)
        return recv.state if recv else None


def test_a_prefill_killed_after_accepting_a_registration_is_noticed_within_a_poll(attention_server):
    http, client = attention_server
    ra = RemoteAttentionSection(servers=[http], transport="tcp", partition="head")
    receiver = AttnPushReceiver(get_transport("tcp", TransportOptions(auth_token=TOKEN)), INFO, TOKEN,
                                (DisaggKVConnectorStats(), threading.Lock()), "recompute", ra,
                                client=lambda: client)  # the model worker's client CLAIMs the blocks
    proc, address = _start_prefill()
    try:
        receiver.start([RecvSpec("d1", "t1", address, (1, 2), 0, 40, PUSH_TIMEOUT_S)])
        deadline = time.monotonic() + 20
        while _state(receiver, "d1") is not RecvState.REGISTERED:  # the prefill side ACCEPTed
            assert _state(receiver, "d1") is RecvState.REGISTERING and time.monotonic() < deadline, _state(receiver, "d1")
            receiver.poll()
            time.sleep(0.01)
        failed, _ = _poll_until(receiver, "d1", 1.0)
        assert _state(receiver, "d1") is RecvState.REGISTERED  # alive and silent: still waiting for its push
        proc.kill()
        proc.wait(timeout=10)
        failed, waited = _poll_until(receiver, "d1", PUSH_TIMEOUT_S)
        assert failed == {"d1"}  # reported failed: the decode instance recomputes the prompt
        assert waited < 2.0, f"noticed after {waited:.1f}s (push_timeout_s={PUSH_TIMEOUT_S})"
        assert "closed its side channel" in receiver.take_errors()["d1"][0]
    finally:
        if proc.poll() is None:
            proc.kill()
        receiver.close()


def test_bytes_still_on_a_slow_link_never_land_in_attention_server_blocks_decode_gave_up():
    """A throttled link from the prefill side to the attention server: D gives up on the push (its
    CANCEL unanswered, the writes stuck in the link), vLLM reuses the blocks; the server must not
    land the rest of the push in them. D reports the failure only once the server fenced it."""
    from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec
    from vllm_disagg.testing.throttle import ThrottledProxy

    NUM_BLOCKS = 4  # noqa: N806
    server = DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN, kv_transport="tcp")
    info = server.start()
    client = DisaggAttentionClient([info["http"]], transport="tcp", auth_token=TOKEN)
    client.connect(num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS, head_size=HEAD, block_size=BS,
                   dtype="float32", max_num_tokens=256)
    sender, receiver = _sender_and_receiver(info["http"], client, layerwise_threshold_tokens=0)
    proxy = ThrottledProxy(receiver._kv_addresses()[0], rate_bytes_per_s=16384)  # 128 KiB on 2 streams: ~4 s
    receiver._kv_addrs = [proxy.address]  # the prefill side reaches the server through the slow link
    try:
        receiver.start([RecvSpec("d1", "fe01", sender.address, tuple(range(1, NUM_BLOCKS + 1)), 0, NUM_BLOCKS * BS, 1.0)])
        # four prefill chunks of one block each: eight writes, four per stream, most of them queued in the link
        for i in range(NUM_BLOCKS):
            spec = SaveSpec("p1", (i + 1,), (i + 1) * BS, NUM_BLOCKS * BS, "fe01", i == 0)
            sender.bind(DisaggConnectorMetadata(save_specs=[spec]))
            for layer in range(LAYERS):
                sender.layer_saved(layer)
            sender.step_done()
            time.sleep(0.05)  # each step its own writes (the sender would merge ready blocks into one)
        failed, _ = _poll_until_failed(receiver, "d1", 20.0)
        assert failed == {"d1"}
        caches = server.kernel.caches
        snapshot, forwarded = [c.clone() for c in caches], proxy.num_forwarded
        deadline = time.monotonic() + 20
        while proxy.num_forwarded < NUM_BLOCKS * LAYERS * INFO.block_nbytes and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert proxy.num_forwarded - forwarded > INFO.block_nbytes  # KV bytes did arrive after the failure
        assert all(torch.equal(a, b) for a, b in zip(snapshot, caches, strict=True))
    finally:
        receiver.close()
        sender.close()
        proxy.close()
        client.close()
        server.stop()


def _poll_until_failed(receiver: AttnPushReceiver, req_id: str, timeout_s: float) -> tuple[set, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        done, failed = receiver.poll()
        if req_id in done | failed:
            return failed, time.monotonic() - t0
        time.sleep(0.01)
    return set(), timeout_s


def test_after_a_server_restart_on_a_new_kv_port_the_next_push_lands_there_without_a_failed_one():
    """A restarted attention server (a Ray actor) keeps its HTTP address but its KV receiver listens
    on a new port: once the model worker's client reconnected (recovery), the next registration asks
    the KV address again, so P pushes to the new port at once instead of failing on the old one while
    D waits out push_timeout_s."""
    from vllm_disagg.attention import recovery
    from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec

    first = DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN, kv_transport="tcp")
    http = first.start()["http"]
    client = DisaggAttentionClient([http], transport="tcp", auth_token=TOKEN)
    client.connect(num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS, head_size=HEAD, block_size=BS,
                   dtype="float32", max_num_tokens=256)
    sender, receiver = _sender_and_receiver(http, client)
    old_kv = receiver._kv_addresses()[0]
    first.stop()
    host, _, port = http.rpartition(":")
    second = DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN, kv_transport="tcp",
                                   http_host=host, http_port=int(port))
    second.start()
    try:
        recovery.reconnect(client, required_blocks=1, wait_s=10)  # the model worker's step recovers
        receiver.start([RecvSpec("d1", "fe02", sender.address, (1, 2), 0, 2 * BS, PUSH_TIMEOUT_S)])
        sender.bind(DisaggConnectorMetadata(save_specs=[SaveSpec("p1", (3, 4), 2 * BS, 2 * BS, "fe02", True)]))
        for layer in range(LAYERS):
            sender.layer_saved(layer)
        sender.step_done()
        failed, waited = _poll_until(receiver, "d1", 10.0)
        assert receiver._kv_addresses()[0] != old_kv and failed == set() and waited < 10.0
        assert torch.equal(second.kernel.caches[0][1], sender.layers[0][3])  # P's block 3 landed in D's block 1
    finally:
        receiver.close()
        sender.close()
        client.close()
        second.stop()


def test_a_push_the_prefill_side_cannot_write_to_an_attention_server_fails_the_receive_in_seconds(attention_server):
    """P's write to the attention server is refused (a KV address gone stale): P abandons the push,
    and the model worker's next STATUS says so, so the request recomputes now, not at push_timeout_s."""
    from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec
    from vllm_disagg.launch.instances import free_ports

    http, client = attention_server
    sender, receiver = _sender_and_receiver(http, client)
    receiver._kv_addrs = [f"127.0.0.1:{free_ports(1)[0]}"]  # nobody listens there
    try:
        receiver.start([RecvSpec("d1", "fe02", sender.address, (1, 2), 0, 2 * BS, PUSH_TIMEOUT_S)])
        sender.bind(DisaggConnectorMetadata(save_specs=[SaveSpec("p1", (1, 2), 2 * BS, 2 * BS, "fe02", True)]))
        for layer in range(LAYERS):
            sender.layer_saved(layer)
        failed, seconds = _poll_until_failed(receiver, "d1", 15.0)
        assert failed == {"d1"} and seconds < 15.0
        assert "abandoned the push" in receiver.take_errors()["d1"][0]
    finally:
        receiver.close()
        sender.close()
