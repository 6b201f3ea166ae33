# SPDX-License-Identifier: Apache-2.0
"""Attention servers that take prefill pushes (`--kv-transport`) keep KV across a model-worker restart:
the decode side CLAIMs a push's blocks before registering it with the prefill side, and the server
moves retained data out of them first (copy-on-write), because the push itself writes block memory
the server never sees. Real servers, clients, channels and a real transport KV sender on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from retain_helpers import BS, GEOM, TOKEN, _attend, _client, _key, _step

from vllm_disagg.attention import wire
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.config import RemoteAttentionSection
from vllm_disagg.kv.handshake import HandshakeInfo
from vllm_disagg.kv.lamina.targets import AttnPushReceiver
from vllm_disagg.kv.metadata import RecvSpec
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.transport import BlockWrite, TransportOptions, get_transport


def _server() -> tuple[DisaggAttentionServer, dict]:
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=2 << 20, auth_token=TOKEN, kv_transport="tcp")
    return srv, srv.start()


@pytest.fixture
def server():
    srv, info = _server()
    yield srv, info
    srv.stop()




def _push(srv: DisaggAttentionServer, src_blocks: list[int], dst_blocks: list[int], tid: str) -> list:
    """A prefill instance's push of whole blocks into the server's cache (the transport P/D uses)."""
    caches = srv.kernel.caches
    data = [torch.randn(max(src_blocks) + 1, *c.shape[1:]) for c in caches]
    sender = get_transport("tcp", TransportOptions(auth_token=TOKEN)).kv_sender(name="prefill")
    try:
        peer = sender.connect(srv.ingest.address, timeout=10)
        for layer, src in enumerate(data):
            peer.write_blocks([BlockWrite(str(layer), src, src_blocks, dst_blocks)], tid, layer).wait(10)
        expect = sum(c[0].nbytes for c in caches) * len(dst_blocks)
        deadline = time.monotonic() + 10
        while srv.ingest.landed([tid])[tid] < expect:
            assert time.monotonic() < deadline, srv.ingest.landed([tid])
            time.sleep(0.005)
    finally:
        sender.close()
    return data


@pytest.mark.parametrize("claim", [True, False], ids=["claimed", "unclaimed"])
def test_a_claimed_retained_block_is_copied_aside_before_a_real_prefill_push_overwrites_it(server, claim):
    """Session 1 writes 100 tokens (blocks 1-3 full), registers 1-3 and decodes. The restarted worker's
    first P/D request gets blocks 1 and 2, and a prefill push overwrites them. With the CLAIM the
    retained blocks restore into 7-9 and the decode equals session 1's bit for bit; without it (the
    negative control) the push destroyed them, which is why servers that take pushes need claims."""
    srv, info = server
    assert srv.retention.ttl_s > 0  # retention is on for a server that takes prefill pushes
    torch.manual_seed(0)
    q, k, v = torch.randn(101, 4, 32), torch.randn(101, 2, 32), torch.randn(101, 2, 32)
    keys = [_key(1), _key(2), _key(3)]
    c1 = _client(info)
    _attend(c1, _step([1, 2, 3, 4], 0, 100), q[:100], k[:100], v[:100])
    c1.queue_registrations([1, 2, 3], keys, [1, 1, 1])
    first = _attend(c1, _step([1, 2, 3, 4], 100, 1), q[100:], k[100:], v[100:])
    c1.close()

    c2 = _client(info)  # the restarted model worker
    assert srv.retention.num_retained == 3
    if claim:
        assert c2.claim([1, 2], timeout_s=5) == set()
        assert srv.retention.copy_bytes == 2 * sum(c[0].nbytes for c in srv.kernel.caches)
    pushed = _push(srv, [0, 1], [1, 2], "tid-1")
    for layer, cache in enumerate(srv.kernel.caches):  # the push really overwrote blocks 1 and 2
        assert torch.equal(cache[1], pushed[layer][0]) and torch.equal(cache[2], pushed[layer][1])
    assert c2.restore([(keys[0], 7), (keys[1], 8), (keys[2], 9)], timeout_s=5) == set()
    _attend(c2, _step([7, 8, 9, 10], 96, 4), q[96:100], k[96:100], v[96:100])  # the tail
    again = _attend(c2, _step([7, 8, 9, 10], 100, 1), q[100:], k[100:], v[100:])
    assert torch.equal(again, first) == claim
    c2.close()


def test_registrations_queued_before_a_claim_ride_on_it_and_the_claim_drops_them(server):
    """A finished request's block registered this step may be a P/D request's push target now: the
    registration goes first and the claim drops it, so the pushed block is never kept under the old key."""
    srv, info = server
    c = _client(info)
    c.queue_registrations([1, 2], [_key(1), _key(2)], [1, 1])
    assert c.claim([1, 5], timeout_s=5) == set()
    assert srv.retention.registered() == {2: _key(2)}
    assert c.claim([], timeout_s=5) == set()
    with pytest.raises(ValueError, match="twice"):
        c.claim([3, 3], timeout_s=5)
    with pytest.raises(ValueError, match="outside"):
        c.claim([c.num_blocks], timeout_s=5)
    c.close()


def test_request_wise_claims_reach_only_the_requests_server_and_unplaced_requests_fail():
    pair = [_server() for _ in range(2)]
    try:
        c = _client(*(i for _, i in pair), partition="request")
        for srv, _ in pair:
            srv.retention.register([5, 6, 9], [_key(5), _key(6), _key(9)])
        where = c.placer.place(5, 64)  # as AttnPushReceiver places a P/D request before claiming
        assert c.claim([5, 6, 9], timeout_s=5, owner_first_block=[5, 5, 9]) == {9}  # 9's request: not placed
        assert pair[where][0].retention.registered() == {9: _key(9)}
        assert pair[1 - where][0].retention.registered() == {5: _key(5), 6: _key(6), 9: _key(9)}
        with pytest.raises(ValueError, match="owner_first_block"):
            c.claim([5], timeout_s=5)
        c.close()
    finally:
        for srv, _ in pair:
            srv.stop()


def test_a_claim_on_a_lost_server_reports_its_blocks_failed_without_raising():
    srv, info = _server()
    c = _client(info)
    srv.stop()
    assert c.claim([1, 2], timeout_s=2) == {1, 2}
    c.close()


def test_bad_claim_frames_get_an_error_and_the_server_keeps_serving(server):
    srv, info = server
    ch = get_transport("tcp", TransportOptions(auth_token=TOKEN)).connect_msg(info["address"], timeout=5)

    def ask(h: wire.Header, tensors) -> wire.Header:
        ch.send(h.pack(), tensors)
        return wire.unpack_header(ch.recv(timeout=5).header)

    assert ask(wire.Header(wire.CLAIM, seq=1), [torch.tensor([1], dtype=torch.int32)]).mtype == wire.ERROR  # no INIT
    assert ask(wire.Header(wire.INIT, seq=2), [wire.Geometry(**GEOM).to_json()]).mtype == wire.INIT_OK
    srv.retention.register([1, 2], [_key(1), _key(2)])
    n = srv.kernel.num_blocks
    bad = {
        "ids not int32": ([b"abc"], 0),
        "block id out of range": ([torch.tensor([n], dtype=torch.int32)], 0),
        "duplicate block id": ([torch.tensor([1, 1], dtype=torch.int32)], 0),
        "two payloads without HAS_REG": ([torch.tensor([1], dtype=torch.int32), b"k" * 16], 0),
        "HAS_REG without the registrations": ([torch.tensor([1], dtype=torch.int32)], wire.HAS_REG),
        "registration keys not 16 bytes": ([torch.tensor([1], dtype=torch.int32),
                                            torch.tensor([3], dtype=torch.int32), b"k" * 15], wire.HAS_REG),
    }
    for seq, (payloads, flags) in enumerate(bad.values(), start=3):
        assert ask(wire.Header(wire.CLAIM, seq=seq, flags=flags), payloads).mtype == wire.ERROR
    assert srv.retention.registered() == {1: _key(1), 2: _key(2)}  # nothing of a rejected frame applied
    assert ask(wire.Header(wire.PING, seq=20), []).mtype == wire.PONG
    ok = ask(wire.Header(wire.CLAIM, seq=21), [torch.tensor([2], dtype=torch.int32)])
    assert (ok.mtype, ok.seq) == (wire.CLAIM_OK, 21)
    assert srv.retention.registered() == {1: _key(1)}
    ch.close()


INFO = HandshakeInfo(model="m", dtype="float32", block_size=BS, kv_layout=f"cpu:float32(2, {BS}, 64)",
                     num_layers=2, num_kv_heads=2, head_size=32, block_nbytes=2 * BS * 64 * 4)


def _receiver(http: str, client) -> AttnPushReceiver:
    ra = RemoteAttentionSection(servers=[http], transport="tcp", partition="head")
    return AttnPushReceiver(get_transport("tcp", TransportOptions(auth_token=TOKEN)), INFO, TOKEN,
                            (DisaggKVConnectorStats(), threading.Lock()), "recompute", ra, client=lambda: client)


def _failure(receiver: AttnPushReceiver, req_id: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, failed = receiver.poll()
        if req_id in failed:
            return receiver.take_errors()[req_id][0]
        time.sleep(0.01)
    raise AssertionError(f"{req_id} did not fail")


def test_the_decode_receiver_claims_a_push_before_registering_it_and_never_registers_an_unclaimed_one(server):
    """Claimed: the server dropped the blocks' registrations before REGISTER went out (the prefill
    address here is dead, so the registration itself fails later). Unclaimed (no attention client):
    the push is refused before REGISTER, and D recomputes the prompt."""
    srv, info = server
    c = _client(info)
    srv.retention.register([1, 2, 3], [_key(1), _key(2), _key(3)])
    claimed = _receiver(info["http"], c)
    try:
        claimed.start([RecvSpec("d1", "t1", "127.0.0.1:9", (1, 2), 0, 40, 5.0)])
        assert srv.retention.registered() == {3: _key(3)}  # synchronous: done when start() returns
        assert "CLAIM" not in _failure(claimed, "d1")  # failed at the (dead) prefill side, after the claim
    finally:
        claimed.close()
    unclaimed = _receiver(info["http"], None)
    try:
        unclaimed.start([RecvSpec("d2", "t2", "127.0.0.1:9", (3,), 0, 20, 5.0)])
        assert "did not confirm the CLAIM" in _failure(unclaimed, "d2")
        assert srv.retention.registered() == {3: _key(3)}
    finally:
        unclaimed.close()
        c.close()


def test_a_claim_and_a_restore_that_time_out_drop_their_late_replies_and_the_channel_goes_on(server, monkeypatch):
    """A slow server (a delayed peer) answers a CLAIM and a RESTORE after the client gave up on them: the
    client drops those late replies when they arrive instead of taking them for the next answers."""
    srv, info = server
    c = _client(info)
    claim, restore = srv._claim, srv._restore

    def slow(fn):
        def wrapped(*args):
            time.sleep(0.8)
            return fn(*args)
        return wrapped

    monkeypatch.setattr(srv, "_claim", slow(claim))
    monkeypatch.setattr(srv, "_restore", slow(restore))
    assert c.claim([3, 4], timeout_s=0.2) == {3, 4}  # timed out: reported failed, no raise
    assert c.restore([(_key(9), 5)], timeout_s=0.2) == {5}
    monkeypatch.setattr(srv, "_claim", claim)
    monkeypatch.setattr(srv, "_restore", restore)
    q, k, v = torch.randn(BS, 4, 32), torch.randn(BS, 2, 32), torch.randn(BS, 2, 32)
    out = _attend(c, _step([1], 0, BS), q, k, v)  # the next step reads past both late replies
    assert torch.isfinite(out).all() and c.conns[0].num_late_replies == 2
    assert c.claim([6], timeout_s=5) == set()
    c.close()
