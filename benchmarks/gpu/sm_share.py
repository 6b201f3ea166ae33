# SPDX-License-Identifier: Apache-2.0
"""Step b, part 1: SM partitions through CUDA green contexts (`nanoflow.units.green_partitions`).

* gemm_vs_sm_share: a bf16 GEMM of LLaMA-8B's gate/up shape at NanoFlow's dense batch (2048 x 4096
  x 28672) on a partition of n SMs, for n across the device: TFLOP/s and the fraction of the whole
  device's rate.
* interference (NanoFlow Fig. 6): the GEMM on g SMs and a memory-bound op (a decode GEMV, and
  decode attention through torch SDPA) on the other SMs, alone and at the same time; each op's
  rate normalised by its rate alone on the whole device, one point per split, plus the same pair
  on two plain streams (no partition: what the hardware scheduler does by itself).
If the runtime refuses green contexts, both checks report `unsupported on this runtime` with the
error and the plain-stream interference is still measured.
"""

from __future__ import annotations

import math
from typing import Any

from common import Budget, StepResult, Unsupported, time_cuda

GEMM_MNK = (2048, 4096, 28672)  # dense batch x hidden x 2*intermediate (LLaMA-3-8B gate/up)
GEMV_ROWS = 16  # decode GEMV: 16 tokens against the down projection's weights (14336 x 4096)
ATTN_SHAPE = (64, 32, 8, 4096, 128)  # batch, query heads, KV heads, context, head dim: 1 GiB of KV
SPLITS = (16, 32, 48, 64, 80, 96, 112, 124)
WINDOW_MS = 25.0


def make_ops(device: str, scale: float = 1.0) -> dict[str, tuple[Any, float, str]]:
    """name -> (fn, work per call, unit): FLOPs for the GEMM, bytes read for the memory-bound ops.
    `scale` shrinks the shapes (the CPU twin runs them at toy size)."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16
    m, k, n = (max(8, int(x * scale)) for x in GEMM_MNK)
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    d_in, d_out = max(8, int(14336 * scale)), max(8, int(4096 * scale))
    x, w = torch.randn(GEMV_ROWS, d_in, device=device, dtype=dtype), torch.randn(d_in, d_out, device=device, dtype=dtype)
    bsz, hq, hkv, ctx, hd = ATTN_SHAPE
    bsz, ctx = max(1, int(bsz * scale)), max(16, int(ctx * scale))
    q = torch.randn(bsz, hq, 1, hd, device=device, dtype=dtype)
    kv = torch.randn(2, bsz, hkv, ctx, hd, device=device, dtype=dtype)
    return {
        "gemm": (lambda: a @ b, 2.0 * m * k * n, "flop"),
        "gemv": (lambda: x @ w, float(w.numel() * w.element_size()), "byte"),
        "decode_attention": (lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True),
                             float(kv.numel() * kv.element_size()), "byte"),
    }


def rate(work: float, ms: float, unit: str) -> float:
    """TFLOP/s or GB/s."""
    return work / (ms * 1e-3) / (1e12 if unit == "flop" else 1e9)


def run_checks(result: StepResult, budget: Budget) -> None:
    ops = make_ops("cuda")
    full = result.run("full_device", lambda: _full_device(ops), budget, 10)
    names = ("gemm_vs_sm_share", "interference_green_contexts", "interference_plain_streams")
    if full["status"] != "ok":
        for name in names:
            result.skip(name, "full_device failed")
        return
    full_rate = full["rate"]
    result.run("gemm_vs_sm_share", lambda: _gemm_vs_share(ops, full_rate), budget, 20)
    result.run("interference_green_contexts", lambda: _interference_green(ops, full_rate), budget, 40)
    result.run("interference_plain_streams", lambda: _interference_plain(ops, full_rate), budget, 15)


def _full_device(ops: dict) -> dict:
    import torch

    full = {name: time_cuda(fn, iters=20)["median_ms"] for name, (fn, _, _) in ops.items()}
    return {"ms": full, "rate": {name: rate(ops[name][1], ms, ops[name][2]) for name, ms in full.items()},
            "units": {"gemm": "TFLOP/s", "gemv": "GB/s", "decode_attention": "GB/s"},
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}


def _partitions(counts: list[int]) -> list[tuple[Any, int]]:
    from vllm_disagg.nanoflow.units import green_partitions

    try:
        return green_partitions(counts)
    except ImportError as err:
        raise Unsupported(f"cuda-bindings not importable: {err}") from None
    except Exception as err:  # the driver or the sandbox refused
        raise Unsupported(f"green contexts: {type(err).__name__}: {err}") from None


def _gemm_vs_share(ops: dict, full_rate: dict) -> dict:
    import torch

    fn, work, unit = ops["gemm"]
    total = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for count in (*SPLITS, total):
        ((stream, granted),) = _partitions([count])
        ms = time_cuda(fn, iters=10, stream=stream)["median_ms"]
        r = rate(work, ms, unit)
        rows.append({"sm_requested": count, "sm_granted": granted, "ms": ms, "tflops": round(r, 1),
                     "fraction_of_full": round(r / full_rate["gemm"], 3)})
    return {"shape_mnk": GEMM_MNK, "rows": rows}


def _concurrent(ops: dict, streams: dict[str, Any], names: tuple[str, str]) -> dict[str, float]:
    """Both ops on their streams for ~WINDOW_MS each, from a common start: each one's ms per call."""
    import torch

    alone = {n: time_cuda(ops[n][0], iters=5, stream=streams[n])["median_ms"] for n in names}
    reps = {n: max(1, math.ceil(WINDOW_MS / max(alone[n], 1e-3))) for n in names}
    torch.cuda.synchronize()
    go = torch.cuda.Event()
    go.record()
    marks = {}
    for n in names:  # queue both before either can finish
        stream = streams[n]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_event(go)
        with torch.cuda.stream(stream):
            start.record(stream)
            for _ in range(reps[n]):
                ops[n][0]()
            end.record(stream)
        marks[n] = (start, end)
    torch.cuda.synchronize()
    return {n: marks[n][0].elapsed_time(marks[n][1]) / reps[n] for n in names} | {f"{n}_alone_here": alone[n]
                                                                                for n in names}


def _point(ops: dict, full_rate: dict, times: dict, names: tuple[str, str]) -> dict:
    out = {}
    for n in names:
        fn, work, unit = ops[n]
        out[f"{n}_normalized"] = round(rate(work, times[n], unit) / full_rate[n], 3)
        out[f"{n}_alone_normalized"] = round(rate(work, times[f"{n}_alone_here"], unit) / full_rate[n], 3)
    return out


def _interference_plain(ops: dict, full_rate: dict) -> dict:
    import torch

    points = []
    for other in ("gemv", "decode_attention"):
        streams = {"gemm": torch.cuda.Stream(), other: torch.cuda.Stream()}
        points.append({"pair": f"gemm+{other}", **_point(ops, full_rate, _concurrent(ops, streams, ("gemm", other)),
                                                          ("gemm", other))})
    return {"points": points, "note": "two plain streams, no SM partition"}


def _interference_green(ops: dict, full_rate: dict) -> dict:
    import torch

    total = torch.cuda.get_device_properties(0).multi_processor_count
    points = []
    for gemm_sms in SPLITS:
        (gemm_stream, granted), (other_stream, rest) = _partitions([gemm_sms, total])
        for other in ("gemv", "decode_attention"):
            streams = {"gemm": gemm_stream, other: other_stream}
            times = _concurrent(ops, streams, ("gemm", other))
            points.append({"pair": f"gemm+{other}", "gemm_sms": granted, "other_sms": rest,
                           **_point(ops, full_rate, times, ("gemm", other))})
    return {"points": points, "method": "NanoFlow Fig. 6: each op's rate with the other running, over its "
                                        "rate alone on the whole device; *_alone_normalized: alone on its partition"}
