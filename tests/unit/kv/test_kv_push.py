# SPDX-License-Identifier: Apache-2.0
"""Prefill sender and decode receiver of the KV push, over real tcp sockets in one process.

No engine: the tests play the engine's part (bind metadata, mark layers saved, poll results) and
check the bytes that land in the decode side's blocks.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import torch

from vllm_disagg.config import KVTransferSection
from vllm_disagg.kv.handshake import HandshakeInfo, MsgType, SideMsg, decode_msg, encode_msg
from vllm_disagg.kv.metadata import CancelSpec, DisaggConnectorMetadata, RecvSpec, SaveSpec
from vllm_disagg.kv.push_receiver import PushReceiver
from vllm_disagg.kv.push_sender import PushSender
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.observe.context import TraceContext
from vllm_disagg.testing.throttle import ThrottledProxy
from vllm_disagg.transport import TransportOptions, get_transport

BS, NUM_LAYERS, NUM_BLOCKS = 16, 3, 32
SHAPE = (NUM_BLOCKS, 2, BS, 8)
INFO = HandshakeInfo(model="m", dtype="float32", block_size=BS, kv_layout="cpu:float32(2, 16, 8)",
                     num_layers=NUM_LAYERS, num_kv_heads=2, head_size=4, block_nbytes=2 * BS * 8 * 4)


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def _transport(kind="tcp"):
    return get_transport(kind, TransportOptions(auth_token="tok", timeout_s=5.0))


class Pair:
    def __init__(self, threshold=0, timeout=5.0, d_info=INFO, data="tcp", verify=False, p_info=INFO):
        self.p_layers = [torch.randn(SHAPE) for _ in range(NUM_LAYERS)]
        self.d_layers = [torch.zeros(SHAPE) for _ in range(NUM_LAYERS)]
        cfg = KVTransferSection(layerwise_threshold_tokens=threshold, push_timeout_s=timeout)
        self.p_stats = DisaggKVConnectorStats()
        self.d_stats = DisaggKVConnectorStats()
        self.sender = PushSender(_transport(), _transport(data), p_info, "tok", self.p_layers, cfg,
                                 (self.p_stats, threading.Lock()))
        self.receiver = PushReceiver(_transport(), _transport(data), d_info, "tok", self.d_layers,
                                     (self.d_stats, threading.Lock()), verify=verify)
        self.done, self.failed = set(), set()

    def prefill_step(self, specs, layers=range(NUM_LAYERS), release=()):
        self.sender.bind(DisaggConnectorMetadata(save_specs=specs, release_req_ids=list(release)))
        for layer in layers:
            self.sender.layer_saved(layer)

    def register(self, tid, dst, timeout=5.0, num_tokens=100, start_block=0, trace=None):
        spec = RecvSpec("d-" + tid, tid, self.sender.address, tuple(dst), start_block, num_tokens, timeout,
                        trace=trace)
        self.receiver.start([spec])

    def poll(self):
        done, failed = self.receiver.poll()
        self.done |= done - failed
        self.failed |= failed
        return self.done | self.failed

    def close(self):
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def pair(request):
    p = Pair(**getattr(request, "param", {}))
    yield p
    p.close()


def _landed(pair, src_ids, dst_ids):
    return all(
        torch.equal(pair.d_layers[layer][d], pair.p_layers[layer][s])
        for layer in range(NUM_LAYERS) for s, d in zip(src_ids, dst_ids, strict=True)
    )


@pytest.mark.parametrize("pair", [{"data": "tcp"}, {"data": "shm"}], indirect=True)
def test_layerwise_push_copies_every_whole_block_of_every_layer_as_each_layer_is_written(pair):
    pair.register("t1", [10, 11, 12, 13, 14, 15, 16])
    # STEP (1) chunk 1: 40 tokens -> blocks 0,1 are whole, block 2 is partial and must wait
    pair.prefill_step([SaveSpec("p1", (3, 4, 5), 40, 100, "t1", True)], layers=[0])
    _until(lambda: pair.d_stats is not None and torch.equal(pair.d_layers[0][11], pair.p_layers[0][4]))
    assert not pair.d_layers[0][12].any() and not pair.d_layers[1][10].any()
    pair.sender.step_done()
    # STEP (2) chunk 2: the remaining 60 tokens, then the request finishes and is released
    pair.prefill_step([SaveSpec("p1", (6, 7, 8, 9), 100, 100)])
    pair.sender.step_done()
    assert _until(lambda: pair.poll()) == {"d-t1"} and not pair.failed
    assert _landed(pair, [3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16])
    assert pair.sender.finished_sending() == set()  # not released yet: blocks stay
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"}
    (push,) = pair.sender.timeline
    assert push["layerwise"] and push["num_writes"] >= NUM_LAYERS + 1
    assert sum(pair.p_stats.data["bytes_pushed"]) == 7 * NUM_LAYERS * INFO.block_nbytes


@pytest.mark.parametrize("pair", [{"threshold": 1000}], indirect=True)
def test_short_prompts_go_in_one_serialized_send_after_the_last_layer(pair):
    pair.prefill_step([SaveSpec("p1", (1, 2, 3, 4, 5, 6, 7), 100, 100, "t1", True)], layers=[0, 1])
    pair.register("t1", [20, 21, 22, 23, 24, 25, 26])  # registration after part of prefill: fine
    time.sleep(0.2)
    assert not pair.poll() and not pair.d_layers[0].any()
    pair.sender.step_done()
    assert _until(pair.poll) == {"d-t1"} and _landed(pair, range(1, 8), range(20, 27))
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"}
    assert pair.sender.timeline[0]["num_writes"] == 1


def test_decode_registered_with_a_local_prefix_hit_receives_only_the_missing_blocks(pair):
    pair.register("t1", [30, 31], num_tokens=100, start_block=5)
    pair.prefill_step([SaveSpec("p1", (1, 2, 3, 4, 5, 6, 7), 100, 100, "t1", True)])
    assert _until(pair.poll) == {"d-t1"} and _landed(pair, [6, 7], [30, 31])
    assert not pair.d_layers[0][:30].any()


@pytest.mark.parametrize("pair", [{"d_info": dataclasses.replace(INFO, dtype="bfloat16")}], indirect=True)
def test_a_handshake_mismatch_fails_both_sides_at_once_and_moves_no_bytes(pair, caplog):
    pair.prefill_step([SaveSpec("p1", (1, 2, 3, 4, 5, 6, 7), 100, 100, "t1", True)])
    t0 = time.monotonic()
    pair.register("t1", range(10, 17))
    _until(lambda: pair.poll() or pair.receiver._errors)
    errors = pair.receiver.take_errors()  # announced (with the reason) one poll before failed_recving
    assert errors["d-t1"][1] is True and "'dtype'" in errors["d-t1"][0]
    assert _until(pair.poll) == {"d-t1"} and pair.failed == {"d-t1"}
    assert time.monotonic() - t0 < 2.0
    assert not any(layer.any() for layer in pair.d_layers)
    assert pair.d_stats.data["num_handshake_failures"] == 1 and pair.p_stats.data["num_handshake_failures"] == 1
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"}  # the prefill side frees its blocks


def test_a_registration_with_no_prefill_request_times_out_and_is_cancelled():
    pair = Pair(timeout=0.5)
    try:
        pair.register("ghost", [1, 2], timeout=0.5)
        assert _until(pair.poll) == {"d-ghost"} and pair.failed == {"d-ghost"}
        assert pair.d_stats.data["num_fallbacks"] == 1
    finally:
        pair.close()


def test_a_prefill_request_nobody_registers_for_is_abandoned_and_freed():
    pair = Pair(timeout=0.3)
    try:
        pair.prefill_step([SaveSpec("p1", (1, 2), 40, 40, "lonely", True)], release=[])
        pair.prefill_step([], release=["p1"])
        assert _until(pair.sender.finished_sending) == {"p1"}
    finally:
        pair.close()


def test_a_dead_prefill_instance_fails_the_receive_fast():
    pair = Pair()
    address = pair.sender.address
    pair.sender.close()
    try:
        t0 = time.monotonic()
        pair.receiver.start([RecvSpec("d1", "t1", address, (1, 2), 0, 40, 30.0)])
        assert _until(pair.poll) == {"d1"} and pair.failed == {"d1"}
        assert time.monotonic() - t0 < 5.0
    finally:
        pair.receiver.close()


def test_preempting_a_prefill_request_abandons_its_push():
    pair = Pair(timeout=0.5)
    try:
        pair.register("t1", range(10, 17), timeout=0.5)
        pair.prefill_step([SaveSpec("p1", (1, 2), 40, 100, "t1", True)])
        pair.sender.bind(DisaggConnectorMetadata(preempted_req_ids=["p1"], release_req_ids=["p1"]))
        assert _until(pair.sender.finished_sending) == {"p1"}
        assert _until(pair.poll) == {"d-t1"} and pair.failed == {"d-t1"}
    finally:
        pair.close()


def test_a_registration_for_a_different_prompt_is_never_pushed():
    pair = Pair(timeout=0.5)
    try:
        pair.register("t1", range(10, 17), timeout=0.5, num_tokens=99)
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)], release=["p1"])
        pair.prefill_step([], release=["p1"])
        assert _until(pair.sender.finished_sending) == {"p1"}
        assert _until(pair.poll) == {"d-t1"} and pair.failed == {"d-t1"}
        assert not any(layer.any() for layer in pair.d_layers)
    finally:
        pair.close()


def test_a_second_request_with_the_same_transfer_id_fails_alone(pair):
    pair.register("t1", range(10, 17))
    pair.receiver.start([RecvSpec("dup", "t1", pair.sender.address, (20,), 0, 100, 5.0)])
    _until(lambda: "dup" in pair.poll())
    assert pair.failed == {"dup"}
    pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
    assert _until(lambda: "d-t1" in pair.poll()) and pair.done == {"d-t1"}
    assert not pair.d_layers[0][20].any()


def test_releasing_a_request_the_sender_never_saw_frees_it_at_once(pair):
    pair.prefill_step([], release=["unknown"])
    assert pair.sender.finished_sending() == {"unknown"}
    assert pair.sender.finished_sending() == set()


def _p_holds(pair, req_id):
    return req_id in pair.sender._pushes and not pair.sender._pushes[req_id].over


def test_a_cancel_ahead_of_the_prefill_request_frees_that_push_the_moment_it_arrives():
    """D took the push over (or its request was aborted) before P's request even started: P never
    waits for a registration, its blocks go back as soon as the request is released."""
    pair = Pair(timeout=30.0)
    try:
        pair.receiver.cancel([CancelSpec("d-x", "t-early", pair.sender.address, "taken over")])
        _until(lambda: "t-early" in pair.sender.plan.cancelled)
        t0 = time.monotonic()
        pair.prefill_step([SaveSpec("p1", (1, 2), 40, 40, "t-early", True)], release=["p1"])
        assert "taken over" in pair.sender._pushes["p1"].error
        assert _until(pair.sender.finished_sending) == {"p1"}
        assert time.monotonic() - t0 < 10.0  # not its push_timeout_s (30 s); loose: the box may be loaded
        assert "t-early" not in pair.sender.plan.cancelled
    finally:
        pair.close()


def test_cancelling_a_waiting_receive_frees_both_sides_at_once_and_lands_nothing_later():
    """The decode request was aborted while it waited for its push (client gone, router cut it)."""
    pair = Pair(timeout=30.0)
    try:
        pair.register("t1", range(10, 17), timeout=30.0)
        pair.prefill_step([SaveSpec("p1", (1, 2), 40, 100, "t1", True)], layers=[0])  # prefill half way
        _until(lambda: pair.sender._pushes["p1"].reg is not None)
        t0 = time.monotonic()
        pair.receiver.cancel([CancelSpec("d-t1", "t1", pair.sender.address, "request aborted")])
        assert _until(pair.poll) == {"d-t1"} and pair.failed == {"d-t1"}  # vLLM frees D's blocks
        assert not _p_holds(pair, "p1") and "request aborted" in pair.sender._pushes["p1"].error
        pair.prefill_step([SaveSpec("p1", (3, 4, 5, 6, 7), 100, 100)], release=["p1"])
        assert _until(pair.sender.finished_sending) == {"p1"}
        assert time.monotonic() - t0 < 10.0  # not its push_timeout_s (30 s)
        snapshot = [layer.clone() for layer in pair.d_layers]
        time.sleep(0.2)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, pair.d_layers, strict=True))
        assert not pair.d_layers[1].any() and not pair.d_layers[2].any()  # layers written after: never sent
    finally:
        pair.close()


def test_bytes_still_on_a_slow_link_when_decode_gives_up_never_land_in_its_freed_blocks():
    """A throttled link: the push outlasts D's timeout, and P's side channel cannot acknowledge the
    CANCEL in time (its writes are stuck in the link), so D gives up unacknowledged while the bytes
    keep arriving. Once D reports the failure (vLLM frees the blocks and hands them to other
    requests), nothing more of that push may land in them: the tcp receiver fences the transfer."""
    pair = Pair(timeout=30.0)
    proxy = ThrottledProxy(pair.receiver.address, rate_bytes_per_s=2048)  # 21 KiB take ~10 s
    pair.receiver.address = proxy.address  # D advertises the slow link, as behind a proxy
    try:
        pair.register("t1", range(10, 17), timeout=1.0)
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
        assert _until(pair.poll, timeout=20.0) == {"d-t1"} and pair.failed == {"d-t1"}
        snapshot, forwarded = [layer.clone() for layer in pair.d_layers], proxy.num_forwarded
        payload = 7 * NUM_LAYERS * INFO.block_nbytes
        _until(lambda: proxy.num_forwarded >= payload, timeout=20.0)  # every byte went over the link
        time.sleep(0.3)
        assert proxy.num_forwarded - forwarded > INFO.block_nbytes  # KV bytes did arrive after the failure
        assert all(torch.equal(a, b) for a, b in zip(snapshot, pair.d_layers, strict=True))
    finally:
        pair.close()
        proxy.close()


def test_a_fence_mid_frame_drains_the_rest_of_the_frame_instead_of_waiting_for_it_to_land():
    """A 7 KiB layer frame over a 2 KiB/s link takes 3.5 s. Fenced 0.5 s into it, the receiver stops
    landing it within a slice and drops the rest off the socket, so the fence holds at once, not once
    the frame is whole; no later byte of the push touches the blocks, and the next push on the same
    connection lands bit-exact (the stream stayed in step)."""
    pair = Pair(timeout=30.0)
    proxy = ThrottledProxy(pair.receiver.address, rate_bytes_per_s=2048)
    pair.receiver.address = proxy.address
    try:
        pair.register("t1", range(10, 17), timeout=30.0)
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
        _until(lambda: proxy.num_forwarded > 3072, timeout=5.0)  # past the handshake: mid first layer frame
        rx = pair.receiver._receiver
        assert not rx.fence("t1")
        t0 = time.monotonic()
        _until(lambda: rx.fence("t1"), timeout=1.0)
        assert time.monotonic() - t0 < 0.5
        snapshot = [layer.clone() for layer in pair.d_layers]
        _until(lambda: proxy.num_forwarded >= 7 * NUM_LAYERS * INFO.block_nbytes, timeout=20.0)
        time.sleep(0.3)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, pair.d_layers, strict=True))
        pair.receiver.cancel([CancelSpec("d-t1", "t1", pair.sender.address, "given up")])
        proxy.set_rate(None)
        pair.register("t2", range(20, 23), num_tokens=48)
        pair.prefill_step([SaveSpec("p2", (1, 2, 3), 48, 48, "t2", True)], release=["p1", "p2"])
        assert "d-t2" in _until(lambda: pair.poll() & {"d-t2"}) and "d-t2" not in pair.failed
        assert all(torch.equal(pair.d_layers[i][20:23], pair.p_layers[i][1:4]) for i in range(NUM_LAYERS))
    finally:
        pair.close()
        proxy.close()


def test_cancelling_a_receive_that_already_landed_changes_nothing(pair):
    pair.register("t1", range(10, 17))
    pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
    assert _until(pair.poll) == {"d-t1"} and not pair.failed
    pair.receiver.cancel([CancelSpec("d-t1", "t1", pair.sender.address, "late abort")])
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"} and pair.sender._pushes == {}


def test_register_carries_the_trace_context_to_the_prefill_side(pair):
    trace = TraceContext.from_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    spec = RecvSpec("d-t1", "t1", pair.sender.address, tuple(range(10, 17)), 0, 100, 5.0, trace=trace)
    pair.receiver.start([spec])
    reg = _until(lambda: pair.sender.plan.registry.get("t1"))
    # the same trace; its parent is D's kv.receive span when this process exports spans (observe)
    assert reg.trace.trace_id == trace.trace_id and reg.trace.to_traceparent().startswith("00-4bf92f35")


def test_a_decode_instance_restarted_on_the_same_address_gets_its_next_push_on_a_new_connection():
    """P keeps a connection per decode receiver; a D that restarted (same port) closed the old one: the next
    push must not be written on it (it would fail, and the new D would wait push_timeout_s)."""
    pair = Pair(timeout=10.0)
    try:
        pair.register("t1", range(10, 17), timeout=10.0)
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)], release=["p1"])
        assert _until(pair.poll) == {"d-t1"} and not pair.failed
        port = int(pair.receiver.address.rsplit(":", 1)[1])
        old_peer = next(iter(pair.sender._peers.values()))
        pair.receiver.close()  # D is killed...
        time.sleep(0.2)
        d_layers = [torch.zeros(SHAPE) for _ in range(NUM_LAYERS)]
        data = get_transport("tcp", TransportOptions(auth_token="tok", timeout_s=5.0, port=port))
        pair.receiver = PushReceiver(_transport(), data, INFO, "tok", d_layers, (pair.d_stats, threading.Lock()))
        pair.d_layers, pair.done = d_layers, set()  # ...and restarted on the same address
        pair.register("t2", range(20, 27), timeout=10.0)
        pair.prefill_step([SaveSpec("p2", tuple(range(1, 8)), 100, 100, "t2", True)], release=["p2"])
        assert _until(pair.poll) == {"d-t2"} and not pair.failed
        assert _landed(pair, range(1, 8), range(20, 27))
        assert _until(lambda: not any(t.is_alive() for t in old_peer._threads))  # the old one is closed
    finally:
        pair.close()


def test_an_aborted_prefill_request_frees_its_push_at_once():
    """The router dropped the attempt (its D failed, or the client left): nobody will register for it."""
    pair = Pair(timeout=30.0)
    try:
        pair.prefill_step([SaveSpec("p1", (1, 2), 40, 40, "t-aborted", True)])
        t0 = time.monotonic()
        pair.sender.bind(DisaggConnectorMetadata(abandoned_req_ids=["p1"], release_req_ids=["p1"]))
        assert _until(pair.sender.finished_sending) == {"p1"}
        assert time.monotonic() - t0 < 10.0  # not its push_timeout_s (30 s)
    finally:
        pair.close()


def test_a_traced_push_is_one_span_with_an_event_per_write_its_bytes_and_exposed_time(pair, spans):
    from vllm_disagg.observe import tracing

    parent = tracing.context_from_headers({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    pair.register("t1", [10, 11, 12, 13, 14, 15, 16], trace=tracing.to_wire(parent))
    pair.prefill_step([SaveSpec("p1", (3, 4, 5, 6, 7, 8, 9), 100, 100, "t1", True, trace=tracing.to_wire(parent))])
    pair.sender.step_done()
    assert _until(pair.poll) == {"d-t1"}
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"}
    receive, span = sorted(spans(), key=lambda s: s.name, reverse=True)
    assert receive.name == "kv.receive" and receive.attributes["disagg.bytes"] == 7 * NUM_LAYERS * INFO.block_nbytes
    assert [e.name for e in receive.events] == ["registered"]
    assert receive.parent.span_id == int("b7ad6b7169203331", 16)
    assert span.name == "kv.push" and span.parent.span_id == receive.context.span_id  # via REGISTER
    layers = [e for e in span.events if e.name == "layer"]
    assert sorted(e.attributes["disagg.layer"] for e in layers) == list(range(NUM_LAYERS))
    assert span.attributes["disagg.bytes"] == 7 * NUM_LAYERS * INFO.block_nbytes
    assert span.attributes["disagg.exposed_ms"] >= 0
    assert {e.name for e in span.events} >= {"registered", "prefill_done"}


@pytest.mark.parametrize("pair", [{"verify": True, "data": "tcp"}, {"verify": True, "data": "shm"}], indirect=True)
def test_a_verified_push_is_done_only_once_the_checksums_of_every_layer_match(pair):
    pair.register("t1", range(10, 17))
    pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
    pair.sender.step_done()
    assert _until(pair.poll) == {"d-t1"} and not pair.failed and _landed(pair, range(1, 8), range(10, 17))
    assert pair.receiver.num_landed == 1 and pair.d_stats.data["num_checksum_mismatches"] == 0
    assert pair.sender.plan.checksums == {}  # taken by D's VERIFY
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"}


@pytest.fixture
def corrupted(request):
    """A pair whose push crosses a proxy that flips one payload byte; yields (pair, proxy) after the push."""
    pair = Pair(verify=request.param)
    proxy = ThrottledProxy(pair.receiver.address, rate_bytes_per_s=None, corrupt_at=4096)
    pair.receiver.address = proxy.address
    try:
        pair.register("t1", range(10, 17))
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
        pair.sender.step_done()
        assert _until(pair.poll) == {"d-t1"} and proxy.num_corrupted == 1
        assert not _landed(pair, range(1, 8), range(10, 17))  # the damage did land
        yield pair, proxy
    finally:
        pair.close()
        proxy.close()


@pytest.mark.parametrize("corrupted", [True], indirect=True)
def test_a_byte_flipped_on_the_link_fails_a_verified_push_instead_of_decoding_from_it(corrupted):
    """No transport checks the bytes that land in D's blocks: a byte flipped inside a payload (here by a
    proxy on the link) lands silently. With verification on, D finds the layer that differs and fails
    the push, so the request recomputes its prompt rather than decode from corrupt KV."""
    pair, _ = corrupted
    assert pair.failed == {"d-t1"}
    assert pair.d_stats.data["num_checksum_mismatches"] == 1 and pair.d_stats.data["num_fallbacks"] == 1
    pair.prefill_step([], release=["p1"])
    assert _until(pair.sender.finished_sending) == {"p1"}


@pytest.mark.parametrize("corrupted", [False], indirect=True)
def test_without_verification_the_same_flipped_byte_lands_unnoticed(corrupted):
    """The control for the test above: the push is reported done although its KV differs."""
    pair, _ = corrupted
    assert not pair.failed and pair.d_stats.data["num_checksum_mismatches"] == 0


def test_a_verify_for_a_push_the_prefill_side_has_no_checksums_of_is_refused_with_the_reason():
    pair = Pair(verify=True, timeout=1.0)
    try:
        reply = decode_msg(pair.receiver._client.call(
            pair.sender.address, encode_msg(SideMsg(MsgType.VERIFY, {"transfer_id": "nope"})), timeout=5.0))
        assert reply.type is MsgType.REJECT and "no checksums for push nope" in reply.body["message"]
    finally:
        pair.close()


def test_a_push_from_a_live_prefill_instance_does_not_wait_behind_registrations_with_a_frozen_one(pair):
    """A SIGSTOPped prefill instance accepts connections (the kernel does) and never answers: each
    REGISTER to it waits out its timeout. Those must not hold up a push from a live one (the 2P+2D
    chaos soak: on one shared pool of 4, requests via the live P waited 15 s)."""
    frozen = socket.create_server(("127.0.0.1", 0), backlog=64)  # never accepts, never answers
    try:
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        pair.receiver.start([RecvSpec(f"d-f{i}", f"f{i}", address, (i,), 0, 100, 3.0) for i in range(6)])
        t0 = time.monotonic()
        pair.register("t1", range(10, 17))
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
        pair.sender.step_done()
        _until(lambda: "d-t1" in pair.poll())
        assert time.monotonic() - t0 < 2.0 and "d-t1" not in pair.failed
        assert _landed(pair, range(1, 8), range(10, 17))
    finally:
        frozen.close()


def test_an_idle_prefill_instances_threads_and_channel_are_let_go(monkeypatch):
    """An autoscaled prefill pool leaves a new address behind with every pod it replaces: the decode
    side keeps threads and a side channel per prefill instance only while it talks to it."""
    from vllm_disagg.kv import push_receiver

    monkeypatch.setattr(push_receiver, "POOL_IDLE_S", 0.3)
    pair = Pair()
    try:
        gone = [f"127.0.0.1:{port}" for port in (1, 2, 3)]  # nothing listens: each CANCEL fails at once
        pair.receiver.cancel([CancelSpec(f"d{i}", f"x{i}", address, "test") for i, address in enumerate(gone)])
        assert set(gone) <= set(pair.receiver._pools)
        time.sleep(0.5)
        pair.register("t1", [10, 11, 12, 13, 14, 15, 16])  # a call to a live prefill instance retires them
        assert set(pair.receiver._pools) == {pair.sender.address}

        def register_threads():
            return [t for t in threading.enumerate() if t.name.startswith("disagg-kv-register")]

        _until(lambda: len(register_threads()) <= 2)  # the live instance's pool alone
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)])
        pair.sender.step_done()
        assert _until(pair.poll) == {"d-t1"} and not pair.failed
    finally:
        pair.close()
