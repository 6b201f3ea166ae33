# SPDX-License-Identifier: Apache-2.0
"""KV retention across a model-worker restart: the registration index, copy-on-write, TTL
(`retain.py` over the real CPU kernel's cache), and the server/client side over real channels
(registrations on step frames, RESTORE, `GET /kv/retained`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from retain_helpers import BS, GEOM, TOKEN, _attend, _client, _key, _step

from vllm_disagg.attention import wire
from vllm_disagg.attention.client import ClientMeta, DisaggAttentionClient
from vllm_disagg.attention.kernels import CpuAttentionKernel
from vllm_disagg.attention.merge import partial_attention
from vllm_disagg.attention.retain import KVRetention
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.transport import TransportOptions, get_transport


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _kernel(num_blocks: int = 8) -> CpuAttentionKernel:
    g = wire.Geometry(num_layers=2, num_heads=2, num_kv_heads=2, head_size=32, block_size=BS, dtype="float32",
                      max_num_tokens=64)
    kern = CpuAttentionKernel(g, num_blocks)
    for layer, c in enumerate(kern.caches):  # block b of layer l holds the value 100*l + b everywhere
        for b in range(num_blocks):
            c[b].fill_(100 * layer + b)
    return kern


def _holds(kern: CpuAttentionKernel, block: int, source: int) -> bool:
    return all(bool((c[block] == 100 * layer + source).all()) for layer, c in enumerate(kern.caches))


# ---- the index (retain.py on the real kernel's cache) ------------------------------------------
def test_registrations_become_the_retained_set_of_the_next_session_and_restore_copies_them():
    kern, ret = _kernel(), KVRetention(ttl_s=60)
    ret.register([1, 2], [_key(1), _key(2)])
    assert ret.new_session() == 2 and ret.num_registered == 0
    assert sorted(ret.keys()[0]) == [_key(1), _key(2)]
    assert ret.restore([5, 6], [_key(2), _key(9)], kern) == [6]  # key 9 was never registered
    assert _holds(kern, 5, 2) and ret.registered() == {5: _key(2)}  # restored blocks are registered


def test_a_write_into_a_registered_block_drops_its_registration():
    kern, ret = _kernel(), KVRetention(ttl_s=60)
    ret.register([1, 2, 3], [_key(1), _key(2), _key(3)])
    ret.before_write([2], kern)  # block 2 was freed and reallocated: its old chain is gone
    assert ret.registered() == {1: _key(1), 3: _key(3)}
    ret.new_session()
    assert sorted(ret.keys()[0]) == [_key(1), _key(3)]


def test_copy_on_write_keeps_retained_data_when_the_new_session_writes_the_block_first():
    kern, ret = _kernel(), KVRetention(ttl_s=60)
    ret.register([1, 2], [_key(1), _key(2)])
    ret.new_session()
    ret.before_write([1], kern)
    kern.caches[0][1].fill_(-1.0)  # the new session's data
    kern.caches[1][1].fill_(-1.0)
    assert ret.copy_bytes == kern.block_nbytes
    assert ret.restore([4, 5], [_key(1), _key(2)], kern) == []
    assert _holds(kern, 4, 1) and _holds(kern, 5, 2)


def test_restore_into_the_block_that_holds_the_key_needs_no_copy_and_chains_are_safe():
    kern, ret = _kernel(), KVRetention(ttl_s=60)
    ret.register([1, 2], [_key(1), _key(2)])
    ret.new_session()
    # key 1 back into its own block 1, key 2's block becomes the target of key 1's copy elsewhere
    assert ret.restore([1, 2, 3], [_key(1), _key(1), _key(2)], kern) == []
    assert _holds(kern, 1, 1) and _holds(kern, 2, 1) and _holds(kern, 3, 2)
    assert ret.copy_bytes == kern.block_nbytes  # only block 2 had to be moved aside


def test_retained_entries_expire_after_the_ttl_and_then_restore_misses():
    clock = _Clock()
    kern, ret = _kernel(), KVRetention(ttl_s=10, clock=clock)
    ret.register([1], [_key(1)])
    ret.new_session()
    keys, ttl = ret.keys()
    assert keys == [_key(1)] and ttl == pytest.approx(10)
    clock.now += 10.5
    assert ret.keys() == ([], 0.0)
    assert ret.restore([3], [_key(1)], kern) == [3]


def test_a_ttl_of_zero_disables_retention():
    ret = KVRetention(ttl_s=0)
    ret.register([1], [_key(1)])
    assert ret.new_session() == 0 and ret.keys()[0] == []


def test_past_the_copy_budget_a_retained_entry_is_dropped_not_corrupted():
    kern = _kernel()
    ret = KVRetention(ttl_s=60, max_copy_bytes=kern.block_nbytes)
    ret.register([1, 2], [_key(1), _key(2)])
    ret.new_session()
    ret.before_write([1, 2], kern)  # room for one copy only
    assert ret.num_retained == 1 and ret.num_dropped == 1
    kern.caches[0][1:3].fill_(-1.0)
    survivor = ret.keys()[0][0]
    assert ret.restore([6], [survivor], kern) == []
    assert _holds(kern, 6, survivor[0])


def test_two_restarts_keep_older_entries_that_were_never_overwritten():
    kern, ret = _kernel(), KVRetention(ttl_s=60)
    ret.register([1, 2], [_key(1), _key(2)])
    ret.new_session()
    ret.restore([3], [_key(1)], kern)  # session 2 uses key 1 only, then dies
    ret.new_session()
    assert sorted(ret.keys()[0]) == [_key(1), _key(2)]
    assert ret.restore([6, 7], [_key(1), _key(2)], kern) == []
    assert _holds(kern, 6, 1) and _holds(kern, 7, 2)


# ---- the server and client over real channels -------------------------------------------------
@pytest.fixture
def server():
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=2 << 20, auth_token=TOKEN)
    info = srv.start()
    yield srv, info
    srv.stop()



def _get_retained(info: dict, token: str | None = TOKEN) -> dict:
    req = urllib.request.Request(f"http://{info['http']}/kv/retained")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())



def test_a_new_session_restores_retained_blocks_and_attends_exactly_as_the_first_did(server):
    """Session 1 writes 100 tokens (blocks 1-3 full, 4 partial), registers 1-3 and decodes.
    Session 2 first writes other data over blocks 1 and 2, then restores the three keys into
    blocks 7-9, recomputes the 4-token tail into block 10 and decodes: the same output."""
    srv, info = server
    torch.manual_seed(0)
    k, v = torch.randn(101, 2, 32), torch.randn(101, 2, 32)
    q = torch.randn(101, 4, 32)
    keys = [_key(1), _key(2), _key(3)]
    c1 = _client(info)
    _attend(c1, _step([1, 2, 3, 4], 0, 100), q[:100], k[:100], v[:100])
    c1.queue_registrations([1, 2, 3], keys, [1, 1, 1])  # rides on the next step's metadata
    first = _attend(c1, _step([1, 2, 3, 4], 100, 1), q[100:], k[100:], v[100:])
    ref, _ = partial_attention(q[100:], k[None], v[None], 0.2)
    torch.testing.assert_close(first, ref, atol=1e-5, rtol=1e-4)
    assert srv.retention.num_registered == 3
    c1.close()

    c2 = _client(info)  # the restarted model worker
    assert sorted(_get_retained(info)["keys"]) == [x.hex() for x in keys]
    _attend(c2, _step([1, 2], 0, 40), torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
    assert c2.restore([(keys[0], 7), (keys[1], 8), (keys[2], 9), (_key(4), 11)], timeout_s=5) == {11}
    _attend(c2, _step([7, 8, 9, 10], 96, 4), q[96:100], k[96:100], v[96:100])  # the tail
    again = _attend(c2, _step([7, 8, 9, 10], 100, 1), q[100:], k[100:], v[100:])
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    text = urllib.request.urlopen(f"http://{info['http']}/metrics", timeout=5).read().decode()
    assert "vllm:disagg_attention_restored_blocks_total 3.0" in text
    assert "vllm:disagg_attention_restore_misses_total 1.0" in text
    c2.close()


def test_head_wise_registrations_and_restores_reach_every_server():
    both = [DisaggAttentionServer(transport="tcp", kv_cache_bytes=2 << 20, auth_token=TOKEN) for _ in range(2)]
    infos = [s.start() for s in both]
    try:
        c1 = _client(*infos)
        _attend(c1, _step([1, 2], 0, 40), torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
        c1.queue_registrations([1], [_key(1)], [1])
        _attend(c1, _step([1, 2], 40, 1), torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32))
        c1.close()
        c2 = _client(*infos)
        assert all(_get_retained(i)["keys"] == [_key(1).hex()] for i in infos)
        both[1].retention.reset()  # one server lost its retained set: the block counts as failed
        assert c2.restore([(_key(1), 5)], timeout_s=5) == {5}
        assert both[0].retention.registered() == {5: _key(1)}
        c2.close()
    finally:
        for s in both:
            s.stop()


def test_retention_happens_only_for_a_new_session_with_the_same_geometry(server):
    srv, info = server
    c1 = _client(info)
    _attend(c1, _step([1, 2], 0, 40), torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
    c1.queue_registrations([1], [_key(1)], [1])
    _attend(c1, _step([1, 2], 40, 1), torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32))
    assert _get_retained(info)["keys"] == []  # still the live session's registration, not retained
    c1.close()
    other = DisaggAttentionClient([info["http"]], transport="tcp", send_q_early=False, auth_token=TOKEN)
    other.connect(**{**GEOM, "num_layers": 3})  # a different model: new KV, nothing kept
    assert _get_retained(info)["keys"] == [] and srv.retention.num_retained == 0
    other.close()


def test_kv_retained_needs_the_token(server):
    _, info = server
    for token in (None, "wrong"):
        with pytest.raises(urllib.error.HTTPError) as err:
            _get_retained(info, token)
        assert err.value.code == 401
    assert _get_retained(info)["keys"] == []


def test_bad_registration_and_restore_frames_get_an_error_and_the_server_keeps_serving(server):
    srv, info = server
    ch = get_transport("tcp", TransportOptions(auth_token=TOKEN)).connect_msg(info["address"], timeout=5)

    def ask(h: wire.Header, tensors) -> wire.Header:
        ch.send(h.pack(), tensors)
        return wire.unpack_header(ch.recv(timeout=5).header)

    assert ask(wire.Header(wire.INIT, seq=1), [wire.Geometry(**GEOM).to_json()]).mtype == wire.INIT_OK
    num_blocks = srv.kernel.num_blocks
    ids = torch.tensor([1, 2], dtype=torch.int32)
    bad = {
        "keys not 16 bytes": [ids, b"x" * 30],
        "ids not int32": [b"abc", b""],
        "too many entries": [torch.arange(num_blocks + 1, dtype=torch.int32), b"k" * 16 * (num_blocks + 1)],
        "block id out of range": [torch.tensor([num_blocks], dtype=torch.int32), b"k" * 16],
        "duplicate block id": [torch.tensor([3, 3], dtype=torch.int32), b"k" * 32],
        "one payload": [ids],
    }
    for seq, payloads in enumerate(bad.values(), start=2):
        assert ask(wire.Header(wire.RESTORE, seq=seq), payloads).mtype == wire.ERROR
    meta = _step([1, 2], 0, 8)
    q, k, v = torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    base = dict(layer=0, num_tokens=8, num_reqs=1, num_cols=2, scale=0.1)
    reg_only = wire.Header(wire.ATTN, seq=20, flags=wire.HAS_REG, meta_id=5, **base)
    assert ask(reg_only, [q, k, v, ids, b"k" * 32]).mtype == wire.ERROR  # registrations without metadata
    with_reg = wire.Header(wire.ATTN, seq=21, flags=wire.HAS_META | wire.HAS_REG, meta_id=6, **base)
    assert ask(with_reg, [q, k, v, *meta.step.tensors(), ids, b"k" * 31]).mtype == wire.ERROR
    assert srv.retention.num_registered == 0  # nothing of a rejected frame applied
    assert ask(wire.Header(wire.PING, seq=22), []).mtype == wire.PONG
    assert ask(with_reg, [q, k, v, *meta.step.tensors(), torch.tensor([2], dtype=torch.int32), b"k" * 16]
               ).mtype == wire.OUT  # block 2: this step writes only block 1, which would drop it at once
    assert srv.retention.registered() == {2: b"k" * 16}
    reply = ch.send(wire.Header(wire.RESTORE, seq=23).pack(), [torch.tensor([4], dtype=torch.int32), _key(7)])
    msg = ch.recv(timeout=5)
    assert reply is None and wire.unpack_header(msg.header).mtype == wire.RESTORE_OK
    assert torch.frombuffer(bytearray(msg.buffers[0]), dtype=torch.int32).tolist() == [4]  # a miss, by block id
    ch.close()


def test_registrations_queued_before_a_restore_are_applied_before_it(server):
    """A finished request's block, registered this step, may be this step's restore target: the
    restore's key must win, so the queued registrations ride on the RESTORE and go first."""
    srv, info = server
    c1 = _client(info)
    _attend(c1, _step([1, 2], 0, 40), torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
    c1.queue_registrations([1], [_key(1)], [1])
    _attend(c1, _step([1, 2], 40, 1), torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32))
    c1.close()
    c2 = _client(info)
    c2.queue_registrations([5], [_key(9)], [5])
    assert c2.restore([(_key(1), 5)], timeout_s=5) == set()
    assert srv.retention.registered() == {5: _key(1)}
    c2.close()


def test_the_same_worker_reconnecting_after_a_server_loss_keeps_its_registrations(server):
    """The recovery path reconnects the same client (INIT flag RESUME): its blocks are still live
    in its scheduler, so they stay registered instead of becoming a retained set to copy aside."""
    from vllm_disagg.attention.client import ServerConn

    srv, info = server
    c1 = _client(info)
    _attend(c1, _step([1, 2], 0, 40), torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
    c1.queue_registrations([1], [_key(1)], [1])
    _attend(c1, _step([1, 2], 40, 1), torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32))
    c1.close()
    c1.conns = [ServerConn(info["http"], c1.transport, c1.timeout_s)]  # as recovery.reconnect does
    c1.connect(**GEOM)
    assert srv.retention.registered() == {1: _key(1)} and srv.retention.num_retained == 0
    c1.close()


def test_a_server_with_a_short_ttl_forgets_the_retained_blocks_and_restore_misses():
    import time

    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=2 << 20, auth_token=TOKEN, retain_ttl_s=0.3)
    info = srv.start()
    try:
        c1 = _client(info)
        _attend(c1, _step([1, 2], 0, 40), torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
        c1.queue_registrations([1], [_key(1)], [1])
        _attend(c1, _step([1, 2], 40, 1), torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32))
        c1.close()
        c2 = _client(info)
        assert _get_retained(info)["keys"] == [_key(1).hex()]
        time.sleep(0.4)
        assert _get_retained(info)["keys"] == []
        assert c2.restore([(_key(1), 5)], timeout_s=5) == {5}
        c2.close()
    finally:
        srv.stop()


def _batch(tables: list[list[int]], start: int, length: int) -> ClientMeta:
    """Requests of equal shape at positions [start, start+length), one block-table row each."""
    steps = [_step(t, start, length).step for t in tables]
    r = len(tables)
    step = wire.StepMeta(torch.arange(r + 1, dtype=torch.int32) * length, torch.cat([s.seq_lens for s in steps]),
                         torch.cat([s.block_table for s in steps]), torch.cat([s.slot_mapping for s in steps]))
    return ClientMeta(step, max_query_len=length, num_actual_tokens=r * length)


def test_request_wise_restore_puts_each_request_on_the_server_that_kept_its_blocks():
    both = [DisaggAttentionServer(transport="tcp", kv_cache_bytes=2 << 20, auth_token=TOKEN) for _ in range(2)]
    infos = [s.start() for s in both]
    try:
        torch.manual_seed(1)
        q, k, v = torch.randn(2, 101, 4, 32), torch.randn(2, 101, 2, 32), torch.randn(2, 101, 2, 32)

        def run(client, tables, start, length):
            sl = slice(start, start + length)
            return _attend(client, _batch(tables, start, length), q[:, sl].flatten(0, 1), k[:, sl].flatten(0, 1),
                           v[:, sl].flatten(0, 1))

        c1 = _client(*infos, partition="request")
        old = [[1, 2, 3, 4], [11, 12, 13, 14]]
        run(c1, old, 0, 100)  # request 0 is placed on server 0, request 1 on server 1 (least load)
        c1.queue_registrations([1, 2, 3, 11, 12, 13], [_key(i) for i in (1, 2, 3, 11, 12, 13)], [1] * 3 + [11] * 3)
        first = run(c1, old, 100, 1)
        c1.close()
        c2 = _client(*infos, partition="request")
        new = [[21, 22, 23, 24], [31, 32, 33, 34]]
        pairs = [(_key(i), b) for i, b in zip((1, 2, 3, 11, 12, 13), (21, 22, 23, 31, 32, 33))]
        assert c2.restore(pairs, timeout_s=5, owner_first_block=[21] * 3 + [31] * 3) == set()
        assert c2.placer._where[21][0] == 0 and c2.placer._where[31][0] == 1
        with pytest.raises(ValueError, match="owner_first_block"):
            c2.restore([(_key(5), 40)], timeout_s=5)
        assert c2.restore([(_key(5), 40)], timeout_s=5, owner_first_block=[40]) == {40}  # a miss, still placed
        assert 40 in c2.placer._where
        run(c2, new, 96, 4)
        torch.testing.assert_close(run(c2, new, 100, 1), first, atol=0, rtol=0)
        c2.close()
    finally:
        for s in both:
            s.stop()


def test_a_later_step_writing_into_a_registered_block_drops_its_registration_over_the_wire(server):
    srv, info = server
    c1 = _client(info)
    _attend(c1, _step([1, 2, 3], 0, 70), torch.randn(70, 4, 32), torch.randn(70, 2, 32), torch.randn(70, 2, 32))
    c1.queue_registrations([1, 2], [_key(1), _key(2)], [1, 1])  # rides on the next step (which writes block 3)
    _attend(c1, _step([1, 2, 3], 70, 1), torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32))
    assert srv.retention.registered() == {1: _key(1), 2: _key(2)}
    # block 2 was freed and now holds another request's first tokens (any offset counts, not only 0)
    _attend(c1, _step([5, 2], 40, 3), torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32))
    assert srv.retention.registered() == {1: _key(1)}
    c1.close()
