# SPDX-License-Identifier: Apache-2.0
"""The op graph and its list schedule: dependencies, per-unit streams, critical path."""

from __future__ import annotations

import pytest

from vllm_disagg.nanoflow.graph import (
    ATTN,
    DENSE,
    NET,
    PipelineSpec,
    build_graph,
    critical_path,
    list_schedule,
)


def _check_valid(nodes, sched):
    by_key = {n.key: n for n in nodes}
    for n in nodes:
        for d in n.deps:
            assert sched.finish[d] <= sched.start[n.key] + 1e-12
    for unit, keys in sched.order.items():
        assert all(by_key[k].unit == unit for k in keys)
        for a, b in zip(keys, keys[1:]):
            assert sched.finish[a] <= sched.start[b] + 1e-12


def test_coarse_ops_wait_for_every_fine_attention_op_they_cover():
    nodes = {n.key: n for n in build_graph(PipelineSpec(2, num_attn_batches=4, num_dense_batches=2))}
    assert set(nodes[("o", 0, 1)].deps) == {("attn", 0, 2), ("attn", 0, 3)}
    assert nodes[("kqv", 1, 3)].deps == (("ugd", 0, 1),)
    assert ("attn", 0, 0) in nodes[("attn", 0, 1)].deps


def test_tensor_parallel_adds_all_reduce_ops_on_the_network_unit():
    nodes = {n.key: n for n in build_graph(PipelineSpec(1, 2, 2, tensor_parallel=True))}
    assert nodes[("ar_o", 0, 1)].unit == NET
    assert nodes[("ugd", 0, 1)].deps == (("ar_o", 0, 1),)
    assert ("ar_d", 0, 0) in nodes


def test_attention_count_must_refine_the_dense_count():
    with pytest.raises(ValueError, match="multiple"):
        PipelineSpec(1, num_attn_batches=3, num_dense_batches=2)


def test_the_schedule_respects_dependencies_and_runs_one_op_at_a_time_per_unit():
    nodes = build_graph(PipelineSpec(3, 4, 2, tensor_parallel=True))
    sched = list_schedule(nodes, lambda n: {"attn": 2.0, "ugd": 3.0}.get(n.name, 1.0))
    _check_valid(nodes, sched)
    assert len(sched.global_order()) == len(nodes)


def test_two_nano_batches_overlap_attention_with_dense_work():
    # one layer, 2 nano-batches: kqv0, kqv1 || attn0, then o0/ugd0 || attn1
    nodes = build_graph(PipelineSpec(1, 2, 2, attn_unit=ATTN))
    sched = list_schedule(nodes, lambda n: 1.0)
    assert sched.start[("kqv", 0, 1)] == sched.start[("attn", 0, 0)] == 1.0
    assert sched.makespan == 6.0  # 7 ops of 1.0 sequentially would take 8


def test_the_critical_path_is_a_chain_ending_at_the_makespan():
    nodes = build_graph(PipelineSpec(2, 2, 1))
    sched = list_schedule(nodes, lambda n: 5.0 if n.name == "attn" else 1.0)
    path = critical_path(sched)
    assert sched.finish[path[-1]] == sched.makespan
    assert sched.start[path[0]] == 0.0
    for a, b in zip(path, path[1:]):
        assert sched.finish[a] == pytest.approx(sched.start[b])
    assert any(k[0] == "attn" for k in path)


def test_unit_orders_follow_one_global_order_so_threads_cannot_deadlock():
    nodes = build_graph(PipelineSpec(2, 4, 2, attn_unit=DENSE))
    sched = list_schedule(nodes, lambda n: 1.0 + (n.nb % 3))
    pos = {k: i for i, k in enumerate(sched.global_order())}
    for n in nodes:
        assert all(pos[d] < pos[n.key] for d in n.deps)
