# SPDX-License-Identifier: Apache-2.0
"""D asks P how a stalled push is doing (STATUS/STATE): a push P abandoned, or one a restarted P never
heard of, fails the receive in seconds instead of at push_timeout_s (30 s here), so the request
recomputes at once. Real sender and receiver over tcp in one process, as in test_kv_push."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch
from test_kv_push import INFO, NUM_LAYERS, SHAPE, Pair, _landed, _transport, _until

from vllm_disagg.config import KVTransferSection
from vllm_disagg.kv.metadata import DisaggConnectorMetadata, RecvSpec, SaveSpec
from vllm_disagg.kv.push_receiver import PushReceiver, RecvState
from vllm_disagg.kv.push_sender import PushSender
from vllm_disagg.kv.push_status import STATUS_AFTER_S, slow_link_reason, slow_link_wait_s
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.testing.sender_process import start_sender_process
from vllm_disagg.testing.throttle import ThrottledProxy
from vllm_disagg.transport import TransportOptions, get_transport

TIMEOUT_S = 30.0


def _failed_within(pair: Pair, req_id: str, seconds: float) -> str:
    t0 = time.monotonic()
    assert _until(pair.poll, timeout=seconds) == {req_id} and pair.failed == {req_id}
    assert time.monotonic() - t0 < seconds
    return pair.receiver.take_errors()[req_id][0]


def test_a_push_the_prefill_side_abandoned_fails_the_receive_in_seconds_not_at_its_timeout():
    pair = Pair(timeout=TIMEOUT_S)
    try:
        pair.register("t1", range(10, 17), timeout=TIMEOUT_S)
        pair.prefill_step([SaveSpec("p1", (1, 2), 40, 100, "t1", True)], layers=[])
        pair.sender.bind(DisaggConnectorMetadata(preempted_req_ids=["p1"], release_req_ids=["p1"]))
        assert _until(pair.sender.finished_sending) == {"p1"}  # P freed it: only STATUS can tell D
        why = _failed_within(pair, "d-t1", 10.0)
        assert "abandoned the push" in why and "preempted" in why
    finally:
        pair.close()


def test_a_prefill_instance_restarted_on_the_same_port_fails_a_registered_receive_in_seconds():
    pair = Pair(timeout=TIMEOUT_S)
    try:
        pair.register("t1", range(10, 17), timeout=TIMEOUT_S)
        _until(lambda: pair.sender.plan.status("t1")[0] == "waiting")  # D's REGISTER was accepted
        port = int(pair.sender.address.rsplit(":", 1)[1])
        pair.sender.close()  # P is killed before its prefill began, and restarts on the same port
        control = get_transport("tcp", TransportOptions(auth_token="tok", timeout_s=5.0, port=port))
        pair.sender = PushSender(control, _transport(), INFO, "tok", pair.p_layers,
                                 KVTransferSection(push_timeout_s=TIMEOUT_S), (pair.p_stats, threading.Lock()))
        why = _failed_within(pair, "d-t1", 15.0)
        assert "no record of the push" in why
    finally:
        pair.close()


def test_a_push_still_waiting_for_its_prefill_is_asked_about_and_left_to_land():
    pair = Pair(threshold=10_000, timeout=TIMEOUT_S)
    try:
        pair.register("t1", range(10, 17), timeout=TIMEOUT_S)
        time.sleep(5.0)  # two STATUS rounds answer "waiting": P has the registration, not the request
        assert not pair.poll()
        assert pair.sender.plan.status("t1") == ("waiting", "")
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)],
                          layers=range(NUM_LAYERS), release=["p1"])
        assert _until(pair.poll) == {"d-t1"} and not pair.failed
        assert _landed(pair, range(1, 8), range(10, 17))
    finally:
        pair.close()


def _poll_for(seconds: float, receiver: PushReceiver, until=lambda: False) -> float:
    """Poll as an engine step does, every 10 ms, for `seconds` or until `until()`; nothing may finish
    or fail. Returns the slowest poll."""
    t_end, slowest = time.monotonic() + seconds, 0.0
    while time.monotonic() < t_end and not until():
        t0 = time.monotonic()
        assert receiver.poll() == (set(), set())
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.01)
    return slowest


class _Unanswered(logging.Handler):
    """When the receiver logged each STATUS call that P did not answer."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "did not answer STATUS" in record.getMessage():
            self.times.append(record.created)


CALL_S = 1.0
"""The receiver's STATUS/CANCEL call timeout in the frozen-P test (`call_timeout_s`, 5 s by default)."""


@pytest.mark.parametrize("stagger_s", [0.0, 0.6], ids=["one_round", "two_rounds"])
def test_a_frozen_prefill_instance_is_asked_again_every_few_seconds_not_on_every_poll(stagger_s):
    """P SIGSTOPped (alive, its sockets open, nothing answered) after accepting two registrations:
    each STATUS round waits out its call (1 s here, 5 s by default), and the next comes STATUS_AFTER_S
    after it, not at once for the round's other receive (b9a98af^: one call apart), nor for a second
    round queued behind it when the receives stalled a poll apart (`two_rounds`; stop 41's CI: 0.1 s
    after). Polls stay instant, both receives wait for their push, and once P runs again it answers."""
    proc, address = start_sender_process(INFO, "tok", SHAPE, TIMEOUT_S, timeout_s=5.0)
    receiver = PushReceiver(_transport(), _transport(), INFO, "tok", [torch.zeros(SHAPE) for _ in range(NUM_LAYERS)],
                            (DisaggKVConnectorStats(), threading.Lock()))
    receiver.call_timeout_s = CALL_S
    unanswered, logger = _Unanswered(), logging.getLogger("vllm_disagg.kv.push_status")
    logger.addHandler(unanswered)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        for i in (1, 2):
            receiver.start([RecvSpec(f"d-t{i}", f"t{i}", address, (2 * i, 2 * i + 1), 0, 20, TIMEOUT_S)])
            _until(lambda i=i: receiver._recvs[f"d-t{i}"].state is RecvState.REGISTERED)
            time.sleep(stagger_s)
        os.kill(proc.pid, signal.SIGSTOP)
        slowest = _poll_for(12.0, receiver, until=lambda: len(unanswered.times) >= 2)
        assert len(unanswered.times) == 2, "P frozen for 12 s and fewer than two STATUS calls timed out"
        gap = unanswered.times[1] - unanswered.times[0]
        assert gap >= STATUS_AFTER_S + 0.9 * CALL_S, f"the next STATUS call went out {gap - CALL_S:.1f}s after one timed out"
        assert slowest < 0.5, f"a poll took {slowest:.2f}s while P was frozen"
        assert receiver._recvs["d-t1"].last_heard.startswith("no answer to STATUS"), "a timeout would not say why"
        os.kill(proc.pid, signal.SIGCONT)  # before the next round (due STATUS_AFTER_S after the last timeout)
        _poll_for(STATUS_AFTER_S + CALL_S + 2.0, receiver)  # that round, which P answers ("waiting")
        assert len(unanswered.times) == 2, "P runs again and still does not answer STATUS"
        assert receiver._recvs["d-t1"].last_heard == "STATUS waiting"
    finally:
        logger.removeHandler(unanswered)
        logger.setLevel(level)
        proc.kill()
        proc.wait(timeout=10)
        receiver.close()


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute_slow_pushes", "off"])
def test_a_push_on_a_slow_link_is_recomputed_once_it_outlasts_its_prefill(recompute):
    """21 KiB over a 4 KiB/s link, the prompt computed at once: P's writes leave at once (into the
    proxy), and by the first STATUS (0.25 s in) P answers `done` with its timing: the bytes have
    been on the link alone longer than the prefill took, so D cancels the push, fences it, and the
    request recomputes instead of waiting the 4 s the link needs. Off, it lands."""
    pair = Pair(timeout=TIMEOUT_S)
    pair.receiver.recompute_slow_pushes = recompute
    proxy = ThrottledProxy(pair.receiver.address, rate_bytes_per_s=4096)
    pair.receiver.address = proxy.address  # D advertises the slow link, as behind a proxy
    try:
        t0 = time.monotonic()
        pair.register("t1", range(10, 17), timeout=TIMEOUT_S)
        pair.prefill_step([SaveSpec("p1", tuple(range(1, 8)), 100, 100, "t1", True)], release=["p1"])
        assert _until(pair.poll, timeout=10.0) == {"d-t1"}
        took = time.monotonic() - t0
        if not recompute:
            assert not pair.failed and _landed(pair, range(1, 8), range(10, 17)) and took > 3.0
            return
        assert pair.failed == {"d-t1"} and took < 1.5, f"given up after {took:.2f}s"
        why = pair.receiver.take_errors()["d-t1"][0]
        assert "slow link" in why and "after its prefill ended" in why
        assert pair.d_stats.data["num_slow_push_recomputes"] == 1 and pair.d_stats.data["num_fallbacks"] == 1
        assert _until(pair.sender.finished_sending) == {"p1"}  # P freed its blocks
    finally:
        pair.close()
        proxy.close()


def test_a_push_waiting_on_its_prefill_compute_is_not_taken_for_a_slow_link():
    """Half the prompt computed, the other half 3 s later: STATUS rounds find P still computing (no
    timing in its STATE), so the receive waits and the push lands whole."""
    pair = Pair(timeout=TIMEOUT_S)
    try:
        pair.register("t1", range(10, 17), timeout=TIMEOUT_S)
        pair.prefill_step([SaveSpec("p1", (1, 2, 3), 48, 100, "t1", True)])
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:
            assert not pair.poll()
            time.sleep(0.01)
        assert pair.receiver._recvs["d-t1"].ask_at > t_end - 1.0  # asked, and told to wait
        pair.prefill_step([SaveSpec("p1", (4, 5, 6, 7), 100, 100)], release=["p1"])
        assert _until(pair.poll) == {"d-t1"} and not pair.failed
        assert _landed(pair, range(1, 8), range(10, 17))
        assert pair.d_stats.data["num_slow_push_recomputes"] == 0
    finally:
        pair.close()


@pytest.mark.parametrize(("body", "gives_up"), [
    ({}, False),  # P still computing
    ({"prefill_s": 0.02, "since_prefill_s": 0.15}, False),  # under MIN_LINK_WAIT_S
    ({"prefill_s": 0.02, "since_prefill_s": 0.25}, True),
    ({"prefill_s": 4.0, "since_prefill_s": 3.9}, False),  # a long prompt: waiting still costs less
    ({"prefill_s": 4.0, "since_prefill_s": 4.1}, True),
    ({"prefill_s": "x", "since_prefill_s": 9}, False),  # malformed: keep waiting (push_timeout_s bounds it)
    ({"prefill_s": 0.1, "since_prefill_s": float("nan")}, False),
])
def test_the_slow_link_rule_waits_as_long_as_a_recompute_would_take(body, gives_up):
    assert (slow_link_reason(body) is not None) is gives_up


def test_the_next_status_comes_when_the_wait_would_match_the_prefill():
    """D asks again when the rule would give up, not a fixed round later."""
    assert slow_link_wait_s({}) is None
    assert slow_link_wait_s({"prefill_s": 0.5, "since_prefill_s": 0.2}) == pytest.approx(0.3)
    assert slow_link_wait_s({"prefill_s": 0.01, "since_prefill_s": 0.05}) == pytest.approx(0.15)
