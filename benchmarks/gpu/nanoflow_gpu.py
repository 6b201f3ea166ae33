# SPDX-License-Identifier: Apache-2.0
"""Step b: NanoFlow on real SMs.

1. `sm_share.py`: GEMM rate against SM share, and the GEMM-vs-GEMV / decode-attention interference
   curve (NanoFlow Fig. 6), through green-context partitions.
2. planner_ops_<model>: each op of `vllm-disagg plan nanoflow --gpu h100` (the CLI, run as a
   subprocess, one GPU) measured at the same workload: GEMMs at the dense batch, decode attention
   over the planner's decode requests at context p + d/2, prefill attention over its prefill
   requests; one row per op with the planner's time (max of its compute and memory times), the
   measured time (per layer x layers) and the error.
3. executor: the project's nano-batch executor (`nanoflow.executor.OpGraphExecutor` on
   `nanoflow.units`) over a torch decoder layer (`decoder.py`) at LLaMA shapes, one layer repeated:
   plain (1 nano-batch, one stream), nano-batched inline (nothing overlaps), and overlapped on two
   SM partitions (green contexts; also on two plain streams). Speedup = plain / overlapped, with the
   overlapped output checked against plain (bf16: rel. error under 1e-2).
0. gpu_unit_tests: `tests/unit/nanoflow/test_executor.py`'s CUDA cases (the executor's stream and
   event ordering on green-context units).
The CPU twin runs 3 at toy size on CPU units (shape, logic and the output check; no figures).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from common import (
    REPO,
    UNSUPPORTED,
    Budget,
    StepResult,
    cuda_ready,
    rel_error,
    run_pytest,
    time_cuda,
    time_host,
)
from decoder import TINY, DecoderLayer, LayerShape, step_fns

# (model, dense batch, prompt p, output d): the planner's workload, sized so that decode attention's
# KV (requests x (p + d/2) tokens) is ~5.6 GB per layer for both models
PLANNER_WORKLOADS = (("llama-3-8b", 2048, 512, 1024), ("llama-2-7b", 1024, 256, 512))
EXECUTOR = {"model": "llama-3-8b", "batch": 512, "context": 1024, "num_layers": 8, "num_attn_batches": 4, "num_dense_batches": 2}
EXECUTOR_TWIN = {"batch": 12, "context": 24, "num_layers": 3, "num_attn_batches": 4, "num_dense_batches": 2}
SPLITS = ((96, "dense"), (66, "dense"))  # dense SMs; attention gets the rest
CHECKS = ("gpu_unit_tests", "full_device", "gemm_vs_sm_share", "interference_green_contexts", "interference_plain_streams",
          "executor", "executor_contiguous_kv", *(f"planner_ops_{m}" for m, *_ in PLANNER_WORKLOADS))


def run_step(device: str, budget: Budget) -> StepResult:
    result = StepResult("b", "NanoFlow on real SMs: SM shares, interference, planner per op, executor overlap",
                        device)
    why_not = cuda_ready() if device == "cuda" else "CPU twin: no GPU"
    if why_not:
        for name in CHECKS:
            if name.startswith("executor"):
                layout = "contiguous" if name.endswith("contiguous_kv") else "paged"
                result.run(name, lambda lay=layout: executor_overlap("cpu", TINY, **EXECUTOR_TWIN, kv_layout=lay),
                           budget, 30)
            else:
                result.skip(name, why_not)
        return result
    import sm_share

    result.run("gpu_unit_tests", lambda: run_pytest("tests/unit/nanoflow/test_executor.py", "-k", "cuda"), budget, 30)
    sm_share.run_checks(result, budget)
    cfg = dict(EXECUTOR)
    model = cfg.pop("model")
    result.run("executor", lambda: {"model": model, **executor_overlap("cuda", LayerShape.of(model), **cfg)},
               budget, 60)
    # the same with attention reading KV in place: does overlap pay once attention is not a gather plus SDPA?
    result.run("executor_contiguous_kv", lambda: {"model": model, **executor_overlap(
        "cuda", LayerShape.of(model), **cfg, kv_layout="contiguous")}, budget, 60)
    for model, dense, prompt, output in PLANNER_WORKLOADS:
        result.run(f"planner_ops_{model}", lambda m=model, b=dense, p=prompt, d=output: planner_ops(m, b, p, d),
                   budget, 40)
    return result


# ------------------------------------------------------------------ planner vs measured, per op
def planner_json(model: str, gpu: str, dense: int, prompt: int, output: int) -> dict:
    cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "plan", "nanoflow", "--model", model, "--gpu", gpu,
           "--num-gpus", "1", "--dense-batch", str(dense), "--prompt", str(prompt), "--output", str(output), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd[2:])} failed: {out.stderr[-1000:]}")
    return json.loads(out.stdout)


def planner_ops(model: str, dense: int, prompt: int, output: int) -> dict:
    import torch

    shape = LayerShape.of(model)
    gpus = ["h100"] + (["h200"] if "H200" in torch.cuda.get_device_name(0) else [])
    plans = {gpu: planner_json(model, gpu, dense, prompt, output) for gpu in gpus}
    plan = plans["h100"]
    layers = _num_layers(model)
    wl = plan["workload"]
    decode_reqs = round(wl["num_requests"] * output / (output + 1))
    prefill_reqs = max(1, round(wl["num_requests"] / (output + 1)))
    measured = {name: ms * layers for name, ms in measure_ops(shape, dense, decode_reqs, prompt + output // 2,
                                                               prefill_reqs, prompt).items()}
    rows = []
    for gpu, p in plans.items():
        for op in p["ops"]:
            predicted = max(op["t_compute_ms"], op["t_mem_ms"], op["t_net_ms"])
            got = measured.get(op["name"])
            rows.append({"gpu_entry": gpu, "op": op["name"], "bound": op["bound"], "predicted_ms": round(predicted, 3),
                         "measured_ms": None if got is None else round(got, 3),
                         "error": None if got is None or not predicted else round(got / predicted - 1, 3)})
    return {"model": model, "planner_command": f"vllm-disagg plan nanoflow --model {model} --gpu h100 --num-gpus 1 "
                                               f"--dense-batch {dense} --prompt {prompt} --output {output} --json",
            "workload": wl, "measured_at": {"decode_requests": decode_reqs, "decode_context": prompt + output // 2,
                                            "prefill_requests": prefill_reqs, "layers": layers},
            "rows": rows, "note": "measured = one layer's op (CUDA events, median) x layers; error = measured / "
                                  "predicted - 1; predicted = max(T_compute, T_mem) of the planner's row"}


def _num_layers(model: str) -> int:
    from vllm_disagg.planner.catalog import get_model

    return get_model(model).num_layers


def measure_ops(shape: LayerShape, dense: int, decode_reqs: int, context: int, prefill_reqs: int,
                prompt: int) -> dict[str, float]:
    """One layer's time (ms) of each planner op on the GPU, bf16, random data."""
    import torch
    import torch.nn.functional as F

    dev, dt = "cuda", torch.bfloat16
    s = shape
    x = torch.randn(dense, s.hidden, device=dev, dtype=dt)
    mats = {"GEMM-KQV": (x, torch.randn(s.hidden, s.q_dim + 2 * s.kv_dim, device=dev, dtype=dt)),
            "GEMM-O": (torch.randn(dense, s.q_dim, device=dev, dtype=dt), torch.randn(s.q_dim, s.hidden, device=dev, dtype=dt)),
            "GEMM-UG": (x, torch.randn(s.hidden, 2 * s.intermediate, device=dev, dtype=dt)),
            "GEMM-D": (torch.randn(dense, s.intermediate, device=dev, dtype=dt),
                       torch.randn(s.intermediate, s.hidden, device=dev, dtype=dt))}
    out = {name: time_cuda(lambda a=a, b=b: a @ b)["median_ms"] for name, (a, b) in mats.items()}
    del mats, x
    out["Decode Attention"] = _decode_attention_ms(s, decode_reqs, context)
    torch.cuda.empty_cache()
    q = torch.randn(prefill_reqs, s.num_heads, prompt, s.head_dim, device=dev, dtype=dt)
    k = torch.randn(prefill_reqs, s.num_kv_heads, prompt, s.head_dim, device=dev, dtype=dt)
    out["Prefill Attention"] = time_cuda(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True,
                                                                                  enable_gqa=True))["median_ms"]
    return out


def _decode_attention_ms(shape: LayerShape, requests: int, context: int) -> float:
    """Paged decode attention of `requests` at `context` (its KV freed on return)."""
    import torch

    layer = DecoderLayer(shape, requests, context, "cuda", torch.bfloat16)
    return time_cuda(lambda: layer.attn(slice(0, requests)), iters=10)["median_ms"]


# ------------------------------------------------------------------ the executor over a decoder layer
def executor_overlap(device: str, shape: LayerShape, batch: int, context: int, num_layers: int, num_attn_batches: int,
                     num_dense_batches: int, kv_layout: str = "paged") -> dict:
    import torch

    from vllm_disagg.nanoflow.executor import OpGraphExecutor

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = DecoderLayer(shape, batch, context, device, dtype, kv_layout=kv_layout)
    plain_plan, nano_plan = step_fns(layer, num_layers, 1, 1), step_fns(layer, num_layers, num_attn_batches, num_dense_batches)
    runs: dict[str, Any] = {}

    def measure(name: str, units: dict, plan, inline: bool) -> None:
        executor = OpGraphExecutor(units, inline=inline)
        try:
            times, out = _time_steps(layer, executor, plan, device)
        finally:
            executor.shutdown()
        runs[name] = {"step_ms": times, "units": [u.describe() for u in units.values()], "output": out}

    measure("plain", _single_unit(device), plain_plan, inline=True)
    measure("nano_inline", _single_unit(device), nano_plan, inline=True)
    overlap, refused = _overlap_units(device)
    for name, units in overlap.items():
        measure(name, units, nano_plan, inline=False)
    ref = runs["plain"].pop("output")
    base = runs["plain"]["step_ms"]["median_ms"]
    for run in runs.values():
        if "output" in run:
            run["rel_error_vs_plain"] = rel_error(run.pop("output"), ref)
        run["speedup_vs_plain"] = round(base / run["step_ms"]["median_ms"], 3)
    limit = 1e-2 if dtype == torch.bfloat16 else 1e-5
    bad = {n: r["rel_error_vs_plain"] for n, r in runs.items() if r.get("rel_error_vs_plain", 0) > limit}
    if bad:
        raise RuntimeError(f"nano-batched output differs from plain beyond {limit}: {bad}")
    runs.update({name: {"status": UNSUPPORTED, "error": err} for name, err in refused.items()})
    return {"shape": shape.__dict__, "batch": batch, "context": context, "num_layers": num_layers, "kv_layout": kv_layout,
            "num_attn_batches": num_attn_batches, "num_dense_batches": num_dense_batches, "dtype": str(dtype), "runs": runs,
            "measured": device == "cuda"}


def _time_steps(layer: DecoderLayer, executor, plan, device: str) -> tuple[dict, Any]:
    import torch

    nodes, schedule, fns = plan

    def step() -> None:
        layer.reset()
        executor.run(nodes, schedule, fns)

    sync = torch.cuda.synchronize if device == "cuda" else None
    times = time_host(step, iters=10 if device == "cuda" else 2, warmup=3 if device == "cuda" else 1, sync=sync)
    step()
    if sync:
        sync()
    return times, layer.x.clone()


def _single_unit(device: str) -> dict:
    if device == "cuda":
        import torch

        from vllm_disagg.nanoflow.units import CudaSmStream

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        return {"dense": CudaSmStream("dense", sms, 0, torch.cuda.Stream())}
    from vllm_disagg.nanoflow.units import make_cpu_units

    return dict(make_cpu_units({"dense": 0}))


def _overlap_units(device: str) -> tuple[dict[str, dict], dict[str, str]]:
    """({run name: units}, {run name: why the runtime refused it})."""
    if device != "cuda":
        from vllm_disagg.nanoflow.units import make_cpu_units

        return {"overlap_cpu_threads": dict(make_cpu_units({"dense": 1, "attn": 1}))}, {}
    import torch

    from vllm_disagg.nanoflow.units import CudaSmStream, green_partitions

    total = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"overlap_plain_streams": {"dense": CudaSmStream("dense", total, 0, torch.cuda.Stream()),
                                     "attn": CudaSmStream("attn", total, 0, torch.cuda.Stream())}}
    refused = {}
    for dense_sms, _ in SPLITS:
        try:
            (d_stream, d_sms), (a_stream, a_sms) = green_partitions([dense_sms, total])
        except Exception as err:  # the runtime refuses green contexts: the plain-stream run still counts
            refused[f"overlap_green_{dense_sms}"] = f"green contexts: {type(err).__name__}: {err}"
            continue
        out[f"overlap_green_{dense_sms}"] = {"dense": CudaSmStream("dense", d_sms, 0, d_stream, capped=True),
                                             "attn": CudaSmStream("attn", a_sms, 0, a_stream, capped=True)}
    return out, refused
