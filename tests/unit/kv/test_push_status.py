# SPDX-License-Identifier: Apache-2.0
"""D asks P how a stalled push is doing (STATUS/STATE): a push P abandoned, or one a restarted P never
heard of, fails the receive in seconds instead of at push_timeout_s (30 s here), so the request
recomputes at once. Real sender and receiver over tcp in one process, as in test_kv_push."""

from __future__ import annotations

import threading
import time

from test_kv_push import INFO, NUM_LAYERS, Pair, _landed, _transport, _until

from vllm_disagg.config import KVTransferSection
from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec
from vllm_disagg.kv.push_sender import PushSender
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
