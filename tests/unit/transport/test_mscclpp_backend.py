# SPDX-License-Identifier: Apache-2.0
"""mscclpp is GPU-only: importing its backend is always safe, selecting it without CUDA/mscclpp
fails at once with one line saying what is missing (never a fallback).

Everything around mscclpp itself (control payloads, ring/seqno protocol, block-run planning, peer
death, credits) runs here through the backend's `Fabric` interface with `HostFabric` (in-process
memmove), over the real authenticated control channel. `MscclppFabric` runs only on a GPU machine
with mscclpp built (`gpu` mark)."""

from __future__ import annotations

import importlib
import sys

import pytest

from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport import TransportKind, TransportOptions


def test_importing_the_mscclpp_backend_needs_neither_cuda_nor_mscclpp():
    mod = importlib.import_module("vllm_disagg.transport.mscclpp")
    assert "mscclpp" not in sys.modules or sys.modules["mscclpp"] is not None
    assert hasattr(mod, "MscclppTransport")


no_mscclpp = pytest.mark.skipif(
    importlib.import_module("vllm_disagg.transport.mscclpp").probe_mscclpp() is None,
    reason="mscclpp and a GPU are present",
)


@no_mscclpp
def test_selecting_mscclpp_without_a_gpu_fails_with_one_clear_line():
    from vllm_disagg.transport.mscclpp import MscclppTransport, probe_mscclpp

    reason = MscclppTransport.unavailable_reason()
    assert isinstance(reason, str) and "\n" not in reason
    if probe_mscclpp() is not None:
        assert reason.startswith("mscclpp is GPU-only: ")
        assert "CUDA" in reason or "mscclpp not installed" in reason
    with pytest.raises(TransportUnavailable) as err:
        MscclppTransport(TransportOptions(auth_token="t"))
    assert "\n" not in str(err.value) and str(err.value).startswith("transport 'mscclpp' cannot run here: ")


@no_mscclpp
def test_get_transport_mscclpp_raises_the_same_one_line_error():
    from vllm_disagg.transport import get_transport

    assert TransportKind("mscclpp") is TransportKind.MSCCLPP
    with pytest.raises(TransportUnavailable, match="^transport 'mscclpp' cannot run here: "):
        get_transport("mscclpp", TransportOptions(auth_token="t"))


# ---- the data path through HostFabric ------------------------------------------------------------
import random  # noqa: E402
import struct  # noqa: E402
import time  # noqa: E402

from vllm_disagg.errors import AuthError, PeerLostError, ProtocolError  # noqa: E402
from vllm_disagg.transport import BlockWrite, XferState  # noqa: E402
from vllm_disagg.transport.mscclpp import proto  # noqa: E402
from vllm_disagg.transport.mscclpp.fabric import HostFabric  # noqa: E402
from vllm_disagg.transport.mscclpp.kv import MscclppKVReceiver, MscclppKVSender  # noqa: E402

BLOCK = 4096


def _blocks(n: int, seed: int | None = None) -> memoryview:
    buf = bytearray(random.Random(seed).randbytes(n * BLOCK) if seed is not None else n * BLOCK)
    return memoryview(buf).cast("B", (n, BLOCK))


def _block(v: memoryview, i: int) -> bytes:
    return v.cast("B")[i * BLOCK : (i + 1) * BLOCK].tobytes()


@pytest.fixture
def pair():
    opts = TransportOptions(auth_token="tok", timeout_s=10.0)
    rx = MscclppKVReceiver(opts, "rx", HostFabric)
    caches = [_blocks(48) for _ in range(2)]
    for i, c in enumerate(caches):
        rx.register_region(f"layer.{i}", c)
    addr = rx.start()
    tx = MscclppKVSender(opts, "tx", HostFabric)
    peer = tx.connect(addr, timeout=10)
    yield rx, tx, peer, caches, addr
    tx.close()
    rx.close()


def test_block_runs_land_bit_exact_and_notify_in_order_over_the_fabric_interface(pair):
    rx, _, peer, caches, _ = pair
    assert sorted(peer.regions) == ["layer.0", "layer.1"] and peer.regions["layer.0"].block_nbytes == BLOCK
    src = [_blocks(40, seed=10 + i) for i in range(2)]
    src_ids, dst_ids = [0, 1, 2, 3, 10, 11, 30, 5, 6, 7, 39], [47, 46, 45, 44, 0, 1, 20, 21, 22, 23, 8]
    h = peer.write_blocks([BlockWrite(f"layer.{i}", src[i], src_ids, dst_ids) for i in range(2)], "req", -1)
    h.wait(10)
    assert h.state() is XferState.DONE
    n = rx.wait_notification(5)
    assert (n.peer, n.transfer_id, n.layer, n.seq, n.nbytes) == ("tx", "req", -1, 0, 2 * 11 * BLOCK)
    for i in range(2):
        assert all(_block(caches[i], d) == _block(src[i], s) for s, d in zip(src_ids, dst_ids))
        assert all(_block(caches[i], d) == bytes(BLOCK) for d in set(range(48)) - set(dst_ids))


def test_three_hundred_writes_pass_a_64_slot_ring_in_seq_order_with_credits_flowing_back(pair):
    rx, _, peer, caches, _ = pair
    src = _blocks(48, seed=7)
    handles = [
        peer.write_blocks([BlockWrite("layer.0", src, [i % 48], [(i * 7) % 48])], f"t{i}", i % 5)
        for i in range(300)
    ]
    got = [rx.wait_notification(10) for _ in range(300)]
    for h in handles:
        h.wait(10)
    assert [n.seq for n in got] == list(range(300))
    assert [n.transfer_id for n in got] == [f"t{i}" for i in range(300)]
    assert all(_block(caches[0], (i * 7) % 48) == _block(src, i % 48) for i in range(252, 300))
    assert rx.poll_notifications() == []


def test_caller_mistakes_raise_at_the_call_and_do_not_consume_a_seq(pair):
    rx, _, peer, _, _ = pair
    src = _blocks(8, seed=1)
    for bad in (
        [BlockWrite("nope", src, [0], [0])],
        [BlockWrite("layer.0", src, [0], [48])],
        [BlockWrite("layer.0", src, [8], [0])],
        [BlockWrite("layer.0", src, [0, 1], [0])],
        [BlockWrite("layer.0", memoryview(bytearray(8 * 512)).cast("B", (8, 512)), [0], [0])],
    ):
        with pytest.raises(ValueError):
            peer.write_blocks(bad, "x")
    with pytest.raises(ValueError, match="transfer_id"):
        peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "t" * 200)
    peer.write_blocks([BlockWrite("layer.0", src, [3], [4])], "ok", 0).wait(10)
    assert rx.wait_notification(5).seq == 0


def test_a_wrong_token_is_rejected_and_the_receiver_keeps_serving(pair):
    rx, _, peer, caches, addr = pair
    bad = MscclppKVSender(TransportOptions(auth_token="wrong", timeout_s=5.0), "intruder", HostFabric)
    with pytest.raises(AuthError):
        bad.connect(addr, timeout=5)
    src = _blocks(4, seed=5)
    peer.write_blocks([BlockWrite("layer.1", src, [1], [2])], "after", 0).wait(10)
    assert rx.wait_notification(5).transfer_id == "after" and _block(caches[1], 2) == _block(src, 1)


def test_a_sender_that_vanishes_is_reported_as_lost(pair):
    rx, _, peer, _, _ = pair
    peer._stream.sock.close()
    deadline, lost = time.monotonic() + 5, []
    while not lost and time.monotonic() < deadline:
        lost = rx.lost_peers()
        time.sleep(0.02)
    assert lost == ["tx"]


def test_a_closed_receiver_fails_pending_writes_with_peer_lost_not_a_hang(pair):
    rx, _, peer, _, _ = pair
    src = _blocks(4, seed=2)
    peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "alive", 0).wait(10)
    rx.close()
    time.sleep(0.3)
    h = peer.write_blocks([BlockWrite("layer.0", src, [1], [1])], "dead", 0)
    with pytest.raises(PeerLostError):
        h.wait(10)
    assert h.state() is XferState.FAILED


def test_control_payloads_round_trip_and_reject_bad_bytes():
    hello = proto.Hello(b"s" * 16, "prefill-0", b"EP", b"CREDIT")
    assert proto.Hello.parse(hello.pack(), "p") == hello
    regions = [proto.RemoteRegion(f"layer.{i}", 10 + i, 4096, bytes([i]) * 9) for i in range(3)]
    welcome = proto.Welcome(b"E" * 40, b"R" * 24, 64, 256, regions)
    assert proto.Welcome.parse(welcome.pack(), "p") == welcome
    raw = welcome.pack()
    for bad, why in [
        (raw[:-1], "truncated"),
        (raw + b"!", "trailing"),
        (struct.pack("<H", 9) + raw[2:], "version"),
        (hello.pack()[:2] + b"x" * 16 + struct.pack("<H", 999), "name of 999"),
    ]:
        with pytest.raises(ProtocolError, match=why):
            (proto.Hello if bad[2:18] == b"x" * 16 else proto.Welcome).parse(bad, "p")
    with pytest.raises(ValueError, match="serialized mscclpp object"):
        proto.Hello(b"s" * 16, "x", b"E" * (proto.MAX_BLOB_BYTES + 1), b"").pack()


def test_host_fabric_refuses_handles_it_did_not_register_and_out_of_range_writes():
    fab = HostFabric()
    local = fab.register(bytearray(64))
    remote = fab.import_memory(local.blob, "p")
    forged = struct.pack("<IQQQ", *struct.unpack("<IQQQ", local.blob)[:2], 0xDEAD000, 64)
    with pytest.raises(ProtocolError, match="no live registration"):
        fab.import_memory(forged, "p")
    link = fab.connect(None, fab.new_endpoint()[1], "p")
    with pytest.raises(ValueError, match="outside"):
        link.write(remote, 60, local, 0, 8)


@pytest.mark.gpu
@pytest.mark.skipif(
    importlib.import_module("vllm_disagg.transport.mscclpp").probe_mscclpp() is not None,
    reason="needs a CUDA GPU and mscclpp built from source (README)",
)
def test_mscclpp_fabric_moves_cuda_blocks_and_notifies():  # pragma: no cover - GPU machines only
    import torch

    from vllm_disagg.transport.mscclpp.fabric import MscclppFabric

    opts = TransportOptions(auth_token="tok", timeout_s=30.0)
    rx = MscclppKVReceiver(opts, "rx", MscclppFabric)
    cache = torch.zeros(16, BLOCK, dtype=torch.uint8, device="cuda")
    rx.register_region("layer.0", cache)
    tx = MscclppKVSender(opts, "tx", MscclppFabric)
    try:
        peer = tx.connect(rx.start(), timeout=30)
        src = torch.randint(0, 255, (16, BLOCK), dtype=torch.uint8, device="cuda")
        peer.write_blocks([BlockWrite("layer.0", src, [0, 1, 5], [3, 4, 9])], "g", 0).wait(30)
        assert rx.wait_notification(10).transfer_id == "g"
        assert torch.equal(cache[[3, 4, 9]], src[[0, 1, 5]])
    finally:
        tx.close()
        rx.close()


def test_mscclpp_channel_env_accepts_port_and_memory_only(monkeypatch):
    from vllm_disagg import envs

    monkeypatch.delenv(envs.VLLM_DISAGG_MSCCLPP_CHANNEL, raising=False)
    assert envs.mscclpp_channel() == "port"
    monkeypatch.setenv(envs.VLLM_DISAGG_MSCCLPP_CHANNEL, "Memory")
    assert envs.mscclpp_channel() == "memory"
    monkeypatch.setenv(envs.VLLM_DISAGG_MSCCLPP_CHANNEL, "nvlink")
    with pytest.raises(ValueError, match="VLLM_DISAGG_MSCCLPP_CHANNEL"):
        envs.mscclpp_channel()
