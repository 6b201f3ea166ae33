# SPDX-License-Identifier: Apache-2.0
"""Splitwise CLS rules (JSQ by pending tokens, mixed pool, health) on hand-made cases."""

import pytest

from vllm_disagg.router.policy import (
    ClusterScheduler,
    NoHealthyInstanceError,
    Pool,
    SchedulerConfig,
)


def _cls(num_p=2, num_d=2, **cfg) -> ClusterScheduler:
    cls = ClusterScheduler(SchedulerConfig(**cfg))
    for i in range(num_p):
        cls.add_instance(f"p{i}", Pool.PREFILL)
    for i in range(num_d):
        cls.add_instance(f"d{i}", "decode")
    return cls


def test_jsq_sends_each_request_to_the_instance_with_fewest_pending_tokens():
    cls = _cls()
    a = cls.pick("a", 1000, 10)
    b = cls.pick("b", 100, 10)
    c = cls.pick("c", 100, 500)
    assert (a.prefill, a.decode) == ("p0", "d0")
    assert (b.prefill, b.decode) == ("p1", "d1")
    # p1 has 100 pending vs p0's 1000; d0 and d1 both have 10 -> first registered.
    assert (c.prefill, c.decode) == ("p1", "d0")
    assert cls.instances["p1"].num_pending_prefill_tokens == 200
    assert not a.colocated


def test_prefill_done_and_request_done_release_the_booked_tokens():
    cls = _cls(1, 1)
    cls.pick("a", 300, 20)
    cls.on_prefill_done("a")
    cls.on_prefill_done("a")  # idempotent
    assert cls.instances["p0"].num_pending_tokens == 0
    cls.on_decode_progress("a", 5)
    assert cls.instances["d0"].num_pending_decode_tokens == 15
    cls.on_request_done("a")
    cls.on_request_done("a")
    d0 = cls.instances["d0"]
    assert (d0.num_pending_tokens, d0.num_kv_tokens, cls.num_active_requests) == (0, 0, 0)


def test_prompt_overflow_borrows_a_token_instance_into_the_mixed_pool_then_returns_it():
    cls = _cls(1, 2, prefill_queue_threshold=1000)
    first = cls.pick("a", 1500, 10)  # p0 queue empty -> p0
    assert first.prefill == "p0" and not first.prefill_via_mixed
    second = cls.pick("b", 200, 10)  # p0 has 1500 >= 1000 pending -> borrow least loaded decode
    assert second.prefill_via_mixed and second.prefill == "d1"
    assert cls.instances["d1"].in_mixed_pool
    third = cls.pick("c", 200, 10)  # mixed pool member under the threshold is used first
    assert third.prefill == "d1" and third.prefill_via_mixed
    cls.on_prefill_done("b")
    assert cls.instances["d1"].in_mixed_pool  # "c" prefill still pending there
    cls.on_prefill_done("c")
    assert not cls.instances["d1"].in_mixed_pool  # no opposite-kind work left: home again


def test_decode_overflow_borrows_a_prompt_instance_and_keeps_kv_local():
    cls = _cls(2, 1, decode_queue_threshold=100)
    cls.pick("a", 10, 150)  # d0 now has 150 pending decode tokens
    b = cls.pick("b", 10, 50)
    # p1 is idle, p0 has a's prefill pending -> p1 prefills; decode overflows to a prefill machine.
    assert b.decode_via_mixed and b.decode in {"p0", "p1"}
    assert cls.instances[b.decode].in_mixed_pool
    cls.on_request_done("b")
    assert not cls.instances[b.decode].in_mixed_pool


def test_memory_aware_decode_skips_instances_whose_kv_would_not_fit():
    cls = ClusterScheduler(SchedulerConfig(decode_queue_threshold=None))
    cls.add_instance("p0", Pool.PREFILL)
    cls.add_instance("d0", Pool.DECODE, kv_capacity_tokens=1000)
    cls.add_instance("d1", Pool.DECODE, kv_capacity_tokens=5000)
    assert cls.pick("a", 100, 100).decode == "d0"
    assert cls.pick("b", 900, 100).decode == "d1"  # d0 would need 1200 > 1000


def test_mixed_home_instances_keep_the_whole_request_like_splitwise_baselines():
    cls = ClusterScheduler()
    cls.add_instance("m0", Pool.MIXED)
    cls.add_instance("m1", Pool.MIXED)
    a, b = cls.pick("a", 500, 5), cls.pick("b", 100, 5)
    assert a.colocated and b.colocated and {a.prefill, b.prefill} == {"m0", "m1"}


def test_unhealthy_instances_are_dropped_and_their_requests_returned_for_restart():
    cls = _cls(2, 1)
    cls.pick("a", 100, 10)
    cls.pick("b", 100, 10)
    lost = cls.mark_unhealthy("p0")
    assert lost == ["a"]
    assert cls.assignment("a") is None and cls.assignment("b") is not None
    assert all(cls.pick(f"r{i}", 10, 1).prefill == "p1" for i in range(3))
    cls.mark_healthy("p0")
    assert cls.pick("z", 10, 1).prefill == "p0"


def test_a_cluster_with_no_healthy_instance_raises_a_clear_error():
    cls = _cls(1, 1)
    cls.mark_unhealthy("p0")
    cls.mark_unhealthy("d0")
    with pytest.raises(NoHealthyInstanceError):
        cls.pick("a", 10, 1)


def test_without_prefill_instances_a_decode_instance_serves_the_prompt():
    cls = _cls(1, 1)
    cls.mark_unhealthy("p0")
    d = cls.pick("a", 10, 1)
    assert d.prefill == d.decode == "d0" and d.colocated


def test_routing_the_same_request_twice_is_rejected():
    cls = _cls(1, 1)
    cls.pick("a", 10, 1)
    with pytest.raises(ValueError):
        cls.pick("a", 10, 1)


def test_when_no_instance_has_kv_room_the_request_queues_on_the_least_loaded_decode():
    cls = ClusterScheduler()
    cls.add_instance("p0", Pool.PREFILL, kv_capacity_tokens=100)
    cls.add_instance("d0", Pool.DECODE, kv_capacity_tokens=1000)
    cls.add_instance("d1", Pool.DECODE, kv_capacity_tokens=1000)
    cls.pick("a", 900, 50)
    cls.pick("b", 900, 10)
    c = cls.pick("c", 900, 50)
    assert c.decode == "d1" and not c.decode_via_mixed  # d1 has fewer pending tokens
    assert not cls.instances["p0"].in_mixed_pool


def test_listeners_hear_joins_returns_and_departures_with_the_requests_booked_there():
    cls = ClusterScheduler()
    heard = []
    cls.listeners.append(lambda iid, healthy, lost: heard.append((iid, healthy, sorted(lost))))
    cls.add_instance("p0", Pool.PREFILL)
    cls.add_instance("d0", Pool.DECODE)
    cls.pick("a", 10, 1)
    cls.pick("b", 10, 1)
    cls.mark_unhealthy("d0")
    cls.mark_healthy("d0")
    assert heard == [("p0", True, []), ("d0", True, []), ("d0", False, ["a", "b"]), ("d0", True, [])]


def test_a_suspect_instance_is_chosen_only_when_no_other_of_its_pool_can_take_the_request():
    cls = _cls()
    cls.pick("a", 100, 10)  # p0 and d0 now carry load; p1 and d1 are idle
    cls.instances["p1"].suspect = cls.instances["d1"].suspect = True
    b = cls.pick("b", 100, 10)
    assert (b.prefill, b.decode) == ("p0", "d0")  # loaded, but showing progress
    assert sorted(cls.requests_on("d0")) == ["a", "b"] and cls.requests_on("p1") == []
    cls.on_prefill_done("a")
    assert cls.requests_on("p0") == ["b"]  # a's prefill is over: it is D's now
    cls.mark_unhealthy("p0")
    c = cls.pick("c", 100, 10)  # the only prefill instance left is suspect: d0 steps, and takes it whole
    assert (c.prefill, c.decode) == ("d0", "d0") and c.colocated
    cls.instances["d0"].suspect = True
    assert cls.pick("d", 100, 10).prefill == "p1"  # every instance is suspect: the least loaded home one
    cls.mark_healthy("p0")
    assert not cls.instances["p0"].suspect
    e = cls.pick("e", 100, 10)  # every decode instance is suspect: a prefill instance that steps decodes
    assert e.decode == e.prefill == "p0"
