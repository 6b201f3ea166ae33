# SPDX-License-Identifier: Apache-2.0
"""The op-graph executor on real unit threads (CPU core groups; CUDA streams when a GPU is lent)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from vllm_disagg import overlap
from vllm_disagg.nanoflow.executor import OpGraphExecutor
from vllm_disagg.nanoflow.graph import ATTN, NET, PipelineSpec, build_graph, list_schedule
from vllm_disagg.nanoflow.units import CpuCoreGroup, allowed_cores, make_cpu_units, make_units


def _unit_kinds():
    kinds = ["cpu"]
    kinds.append(
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
        )
    )
    return kinds


def _units(kind: str, names=("dense", "attn", "net")):
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    return make_units({n: 1 for n in names}, device)


@pytest.mark.parametrize("kind", _unit_kinds())
def test_every_op_runs_once_after_its_dependencies_on_its_own_unit(kind):
    spec = PipelineSpec(2, 4, 2, tensor_parallel=True, attn_unit=ATTN)
    nodes = build_graph(spec)
    sched = list_schedule(nodes, lambda n: 1.0)
    log, lock = [], threading.Lock()

    def make(key):
        def fn():
            with lock:
                log.append((key, threading.current_thread().name))

        return fn

    ex = OpGraphExecutor(_units(kind))
    try:
        ex.run(nodes, sched, {n.key: make(n.key) for n in nodes})
    finally:
        ex.shutdown()
    pos = {k: i for i, (k, _) in enumerate(log)}
    assert len(log) == len(nodes)
    by_key = {n.key: n for n in nodes}
    for key, thread in log:
        assert thread == f"nanoflow-{by_key[key].unit}"
        assert all(pos[d] < pos[key] for d in by_key[key].deps)


@pytest.mark.parametrize("kind", _unit_kinds())
def test_dataflow_results_are_the_same_on_unit_threads_as_inline(kind):
    spec = PipelineSpec(2, 4, 2, tensor_parallel=True, attn_unit=ATTN)
    nodes = build_graph(spec)
    sched = list_schedule(nodes, lambda n: 1.0 + n.nb)
    dev = "cuda" if kind == "cuda" else "cpu"

    def run(inline):
        vals = {}

        def make(node):
            def fn():
                x = torch.full((64,), float(hash(node.key) % 97), device=dev)
                for d in node.deps:
                    x = x * 0.5 + vals[d].sin()
                vals[node.key] = x

            return fn

        ex = OpGraphExecutor(_units(kind), inline=inline)
        try:
            ex.run(nodes, sched, {n.key: make(n) for n in nodes})
        finally:
            ex.shutdown()
        return torch.stack([vals[n.key] for n in nodes]).cpu()

    assert torch.equal(run(True), run(False))


def test_a_blocking_network_op_overlaps_dense_work_of_the_other_nano_batch():
    spec = PipelineSpec(1, 2, 2, attn_unit=NET)
    nodes = build_graph(spec)
    sched = list_schedule(nodes, lambda n: 1.0)
    spans = {}

    def make(key):
        def fn():
            t0 = time.monotonic()
            time.sleep(0.3 if key[0] == "attn" else 0.15)  # a blocking RPC / a compute op
            spans[key] = (t0, time.monotonic())

        return fn

    ex = OpGraphExecutor(make_cpu_units({"dense": 0, "net": 0}))
    try:
        ex.run(nodes, sched, {n.key: make(n.key) for n in nodes})
    finally:
        ex.shutdown()
    a0, k1 = spans[("attn", 0, 0)], spans[("kqv", 0, 1)]
    assert k1[0] < a0[1] and a0[0] < k1[1]  # kqv of nano-batch 1 ran during attn of nano-batch 0


def test_an_error_in_one_unit_aborts_the_step_and_reaches_the_caller():
    nodes = build_graph(PipelineSpec(2, 2, 2, attn_unit=ATTN))
    sched = list_schedule(nodes, lambda n: 1.0)
    ran = []

    def boom():
        raise RuntimeError("attention failed")

    fns = {n.key: (lambda k=n.key: ran.append(k)) for n in nodes}
    fns[("attn", 0, 1)] = boom
    ex = OpGraphExecutor(make_cpu_units({"dense": 0, "attn": 0}))
    try:
        with pytest.raises(RuntimeError, match="attention failed"):
            ex.run(nodes, sched, fns)
        assert ("o", 0, 1) not in ran and ("kqv", 1, 0) not in ran
        ex.run(nodes, sched, {n.key: (lambda: None) for n in nodes})  # the executor still works
    finally:
        ex.shutdown()


def test_side_network_work_is_drained_before_the_step_returns_and_knows_its_nano_batch():
    nodes = build_graph(PipelineSpec(1, 2, 2, attn_unit=ATTN))
    sched = list_schedule(nodes, lambda n: 1.0)
    pushed = []

    def push(info):
        time.sleep(0.05)
        pushed.append(info)

    def attn_op():
        overlap.submit_network(push, overlap.current_nano_batch())

    fns = {n.key: (attn_op if n.name == "attn" else (lambda: None)) for n in nodes}
    ex = OpGraphExecutor(make_cpu_units({"dense": 0, "attn": 0}))
    try:
        ex.run(nodes, sched, fns)
    finally:
        ex.shutdown()
    assert sorted((i.op, i.layer, i.index, i.count) for i in pushed) == [("attn", 0, 0, 2), ("attn", 0, 1, 2)]
    assert overlap.current_nano_batch() is None


def test_network_bound_attention_is_declared_on_the_impl():
    class Impl:
        nanoflow_network_bound = True

    class Layer:
        impl = Impl()

    assert overlap.is_network_bound(Layer())
    assert not overlap.is_network_bound(object())


@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs 2 cores")
def test_cpu_units_are_pinned_to_disjoint_core_sets_with_their_own_thread_counts():
    units = make_cpu_units({"dense": 1, "attn": 1})
    assert set(units["dense"].cores).isdisjoint(units["attn"].cores)
    seen = {}

    def probe(unit: CpuCoreGroup):
        unit.bind()
        seen[unit.name] = (os.sched_getaffinity(0), torch.get_num_threads())

    threads = [threading.Thread(target=probe, args=(u,)) for u in units.values()]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert seen["dense"] == (set(units["dense"].cores), 1)
    assert seen["attn"] == (set(units["attn"].cores), 1)


def _concurrency_probe(units, exclusive):
    """Ops on dense/attn/net with no dependencies; returns the max number of ops seen running
    at once per pair of units."""
    from vllm_disagg.nanoflow.graph import OpNode, Schedule

    nodes = [OpNode(f"op{u}", 0, i, u) for u in units for i in range(6)]
    order = {u: [n.key for n in nodes if n.unit == u] for u in units}
    sched = Schedule(order=order, start={n.key: 0.0 for n in nodes}, finish={n.key: 1.0 for n in nodes})
    lock, running, peak = threading.Lock(), set(), {"max": 0}

    def make(unit):
        def fn():
            with lock:
                running.add(unit)
                peak["max"] = max(peak["max"], len(running))
            time.sleep(0.002)  # widen the window a concurrent op would fall into
            with lock:
                running.discard(unit)

        return fn

    ex = OpGraphExecutor(make_units({u: 1 for u in units}, torch.device("cpu")), exclusive_units=exclusive)
    try:
        ex.run(nodes, sched, {n.key: make(n.unit) for n in nodes})
    finally:
        ex.shutdown()
    return peak["max"]


def test_ops_on_exclusive_cpu_units_never_run_at_the_same_time():
    # vLLM's CPU attention and oneDNN GEMM share one global scratchpad: they must not overlap
    assert _concurrency_probe(("dense", "attn"), exclusive=("dense", "attn")) == 1


def test_a_network_op_still_overlaps_an_exclusive_dense_op():
    from vllm_disagg.nanoflow.graph import OpNode, Schedule

    dense_started, net_started = threading.Event(), threading.Event()

    def dense():
        dense_started.set()
        assert net_started.wait(10), "the net op never ran while the dense op held the kernel lock"

    def net():
        net_started.set()
        assert dense_started.wait(10)

    nodes = [OpNode("ugd", 0, 0, "dense"), OpNode("ar_d", 0, 0, NET)]
    sched = Schedule(
        order={"dense": [nodes[0].key], NET: [nodes[1].key]},
        start={n.key: 0.0 for n in nodes},
        finish={n.key: 1.0 for n in nodes},
    )
    ex = OpGraphExecutor(make_units({"dense": 1, NET: 0}, torch.device("cpu")), exclusive_units=("dense",))
    try:
        ex.run(nodes, sched, {nodes[0].key: dense, nodes[1].key: net})
    finally:
        ex.shutdown()


def test_the_runner_makes_every_cpu_unit_but_net_exclusive_and_none_on_gpu():
    from vllm_disagg.nanoflow.runner import cpu_exclusive_units

    shares = {"dense": 1, "attn": 1, NET: 0}
    assert cpu_exclusive_units(shares, torch.device("cpu")) == {"dense", "attn"}
    assert cpu_exclusive_units(shares, torch.device("cuda", 0)) == frozenset()


def test_vllm_gemms_on_two_exclusive_unit_threads_give_exact_results():
    # Without CPU_KERNEL_LOCK two threads in onednn_mm share one scratchpad: measured ~4 wrong
    # results per 3000 calls here, and the SIGSEGV of test_nanoflow.py when attention joins in.
    from vllm import _custom_ops as ops

    from vllm_disagg.nanoflow.graph import OpNode, Schedule

    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("vLLM built without oneDNN")
    units = ("dense", "attn")
    gemms = {}
    for i, unit in enumerate(units):
        g = torch.Generator().manual_seed(i)
        w, x = torch.randn(1536, 512, generator=g), torch.randn(40 + 8 * i, 512, generator=g)
        gemms[unit] = (ops.create_onednn_mm(w.t(), 32), x, x @ w.t())
    wrong = []

    def make(unit):
        handler, x, ref = gemms[unit]

        def fn():
            for _ in range(250):
                y = ops.onednn_mm(handler, x, None)
                if not torch.allclose(y, ref, atol=1e-3, rtol=1e-3):
                    wrong.append(unit)

        return fn

    nodes = [OpNode("gemm", 0, i, u) for u in units for i in range(6)]
    order = {u: [n.key for n in nodes if n.unit == u] for u in units}
    sched = Schedule(order=order, start={n.key: 0.0 for n in nodes}, finish={n.key: 1.0 for n in nodes})
    ex = OpGraphExecutor(make_units({u: 1 for u in units}, torch.device("cpu")), exclusive_units=units)
    try:
        ex.run(nodes, sched, {n.key: make(n.unit) for n in nodes})
    finally:
        ex.shutdown()
    assert wrong == []
