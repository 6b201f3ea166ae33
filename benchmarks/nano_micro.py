# SPDX-License-Identifier: Apache-2.0
"""nano_bench.py's engine-free figures: TP=2 all-reduce overlap at the executor level (two gloo
ranks, TP-sharded GEMMs, no vLLM) and, when a GPU is lent, GEMM slowdown under a co-running GEMV
with and without SM limits. Secondary keys only: none is against what a user would otherwise run."""

from __future__ import annotations

import os
import statistics
import time


# ----------------------------------------------------- executor cost per op
def executor_overhead_us_per_op(num_layers: int, reps: int = 200) -> float:
    """The executor's own cost per op (inline, no-op ops, best of 5): what the machinery adds
    on top of the doubled per-op cost of vLLM's kernels and Python layers."""
    from vllm_disagg.nanoflow.executor import OpGraphExecutor
    from vllm_disagg.nanoflow.graph import PipelineSpec, build_graph, list_schedule
    from vllm_disagg.nanoflow.units import make_cpu_units

    nodes = build_graph(PipelineSpec(num_layers, 2, 2))
    sched = list_schedule(nodes, lambda n: 1.0)
    fns = {n.key: (lambda: None) for n in nodes}
    ex = OpGraphExecutor(make_cpu_units({"dense": 0}), inline=True)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            ex.run(nodes, sched, fns)
        best = min(best, (time.perf_counter() - t0) / reps)
    ex.shutdown()
    return best / len(nodes) * 1e6


# ----------------------------------------------------- executor-level TP=2 (gloo)
def _tp_rank(rank: int, port: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    from vllm_disagg.nanoflow.executor import OpGraphExecutor
    from vllm_disagg.nanoflow.graph import DENSE, NET, PipelineSpec, build_graph, list_schedule
    from vllm_disagg.nanoflow.units import make_cpu_units

    core = rank % os.cpu_count()
    os.sched_setaffinity(0, {core})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    d, inter, q, tokens, layers = 1024, 2816 // 2, 512, 128, 4
    w = {
        "kqv": torch.randn(q + q // 2, d),
        "o": torch.randn(d, q),
        "gu": torch.randn(2 * inter, d),
        "d": torch.randn(d, inter),
    }
    lin = torch.nn.functional.linear

    def make_step(n: int, threaded: bool):
        spec = PipelineSpec(
            layers, n, n, tensor_parallel=True, attn_unit=DENSE, net_unit=NET if threaded else DENSE
        )
        nodes = build_graph(spec)
        sched = list_schedule(nodes, lambda node: 2.0 if node.name == "ugd" else 1.0)
        x, a, buf = torch.randn(tokens // n, d), torch.randn(tokens // n, q), {}

        def fn(node):
            name, layer, b = node.key
            if name == "kqv":
                return lambda: lin(x, w["kqv"])
            if name == "o":
                return lambda: buf.__setitem__(("o", layer, b), lin(a, w["o"]))
            if name == "ugd":
                return lambda: buf.__setitem__(
                    ("d", layer, b), lin(torch.relu(lin(x, w["gu"])[:, :inter]), w["d"])
                )
            if name == "attn":
                return lambda: None
            return lambda: dist.all_reduce(buf[("o" if name == "ar_o" else "d", layer, b)])

        fns = {node.key: fn(node) for node in nodes}
        units = make_cpu_units({DENSE: 1, NET: 0} if threaded else {DENSE: 1}, cores=(core,))
        ex = OpGraphExecutor(units, inline=not threaded)
        return ex, lambda: ex.run(nodes, sched, fns)

    modes = {
        "plain": make_step(1, False),
        "nano2_inline": make_step(2, False),
        "nano2_overlap": make_step(2, True),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    with torch.inference_mode():
        for _ in range(reps + 1):  # first round warms up
            for mode, (_ex, step) in modes.items():
                dist.barrier()
                t0 = time.perf_counter()
                step()
                dist.barrier()
                times[mode].append(time.perf_counter() - t0)
    for ex, _ in modes.values():
        ex.shutdown()
    if rank == 0:
        out.put({m: t[1:] for m, t in times.items()})
    dist.destroy_process_group()


def bench_tp_executor(quick: bool) -> dict:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, 7 if quick else 21, out)) for r in range(2)]
    for p in procs:
        p.start()
    t = out.get(timeout=600)
    for p in procs:
        p.join(timeout=30)

    def ratio(num: str, den: str) -> float:
        return statistics.median(b / a for a, b in zip(t[num], t[den]))

    return {
        "tp_allreduce_overlap_speedup": ratio("nano2_overlap", "nano2_inline"),
        "tp_overlap_vs_plain": ratio("nano2_overlap", "plain"),
        "tp_step_s_median": {m: statistics.median(v) for m, v in t.items()},
        "tp_allreduce_method": "executor-level: 2 gloo ranks, TP-sharded GEMMs (d=1024), real all_reduce, no engine",
    }


# ------------------------------------------------------------ GPU (when lent)
def bench_gpu_interference() -> dict:
    """GEMM slowdown when a GEMV stream co-runs, without and with SM limits (paper: up to 2.5x).

    UNTESTED HERE (no GPU on this box); runs only when CUDA is available."""
    import torch

    from vllm_disagg.nanoflow.units import make_gpu_units

    a, b = (
        torch.randn(4096, 4096, device="cuda", dtype=torch.float16),
        torch.randn(4096, 4096, device="cuda", dtype=torch.float16),
    )
    kv, q = (
        torch.randn(256, 4096, 128, device="cuda", dtype=torch.float16),
        torch.randn(256, 1, 128, device="cuda", dtype=torch.float16),
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def gemm_ms(gemm_stream, gemv_stream=None, iters=50) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if gemv_stream is not None:
            with torch.cuda.stream(gemv_stream):
                for _ in range(iters * 4):
                    torch.bmm(q, kv.transpose(1, 2))
        with torch.cuda.stream(gemm_stream):
            start.record()
            for _ in range(iters):
                a @ b
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    plain = torch.cuda.Stream()
    alone = gemm_ms(plain)
    shared = gemm_ms(plain, torch.cuda.Stream())
    units = make_gpu_units({"dense": int(sms * 0.75), "attn": sms - int(sms * 0.75)})  # disjoint SM partitions
    dense, mem = units["dense"], units["attn"]
    limited = gemm_ms(dense.stream, mem.stream)
    return {
        "gpu_gemm_slowdown_no_sm_limit": shared / alone,
        "gpu_gemm_slowdown_sm_limited": limited / alone,
        "gpu_green_contexts": dense.capped and mem.capped,
    }
