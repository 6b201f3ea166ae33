# SPDX-License-Identifier: Apache-2.0
"""Split network attention: the request goes out from KQV, the "net" unit only waits for it. Waits
are deferred only inside `deferred_waits()`, and the runner splits only when the schedule waits in
the order the dense unit sends (replies come back in send order per channel)."""

import threading

from vllm_disagg.nanoflow.graph import NET, PipelineSpec, Schedule, build_graph, list_schedule
from vllm_disagg.nanoflow.runner import sends_in_wait_order
from vllm_disagg.overlap import defer_wait, deferred_waits

PER_TOKEN = {"kqv": 512 * 1024, "attn": 4 * 512 * 64, "o": 512 * 512, "ugd": 3 * 512 * 1536}


def test_a_wait_is_kept_for_the_caller_only_inside_deferred_waits():
    ran = []
    assert defer_wait(lambda: ran.append("outside")) is False  # the op must wait itself
    with deferred_waits() as waits:
        assert defer_wait(lambda: ran.append("a")) is True
        assert defer_wait(lambda: ran.append("b")) is True
    assert ran == [] and len(waits) == 2
    for w in waits:
        w()
    assert ran == ["a", "b"]
    assert defer_wait(lambda: None) is False  # the collector is gone after the block


def test_nested_collectors_restore_the_outer_one_and_other_threads_are_not_affected():
    with deferred_waits() as outer:
        with deferred_waits() as inner:
            defer_wait(lambda: None)
        seen = []
        t = threading.Thread(target=lambda: seen.append(defer_wait(lambda: None)))
        t.start()
        t.join()
        defer_wait(lambda: None)
    assert len(inner) == 1 and len(outer) == 1 and seen == [False]


def _remote_schedule(num_attn_batches: int, num_dense_batches: int, layers: int = 4):
    spec = PipelineSpec(num_layers=layers, num_attn_batches=num_attn_batches, num_dense_batches=num_dense_batches, attn_unit=NET)
    nodes = build_graph(spec)

    def cost(node):  # the runner's default for remote attention: as long as a dense layer
        if node.name == "attn":
            return sum(PER_TOKEN[n] for n in ("kqv", "o", "ugd")) * 16
        return PER_TOKEN[node.name] * 16

    return spec, list_schedule(nodes, cost, serial={"dense"})


def test_the_ping_pong_schedule_waits_in_the_order_kqv_sends():
    for num_attn_batches, num_dense_batches in ((2, 2), (2, 1), (4, 2)):
        spec, schedule = _remote_schedule(num_attn_batches, num_dense_batches)
        assert sends_in_wait_order(schedule, spec), (num_attn_batches, num_dense_batches)


def test_a_schedule_that_waits_out_of_send_order_is_not_split():
    spec, schedule = _remote_schedule(2, 2, layers=1)
    swapped = dict(schedule.order)
    net = list(swapped[NET])
    net[0], net[1] = net[1], net[0]
    swapped[NET] = net
    assert not sends_in_wait_order(Schedule(swapped, schedule.start, schedule.finish), spec)
