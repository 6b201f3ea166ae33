# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg tune`: profile ops on this device, search the nano-batch plan, write its JSON.

    vllm-disagg tune --model DIR [--out plan.json] [--max-tokens 512] [--tp 2] [--remote-rpc-us 80]

The plan goes to `--out`, or to the default location that `num_nano_batches: "auto"` loads
(`$VLLM_DISAGG_CACHE/nanoflow/<model>.json`). Use it with
`additional_config={"disagg": {"nanoflow": {"num_nano_batches": "auto", "plan": PATH}}}`, and set
`--max-num-batched-tokens` to the printed dense batch size (discrete batching).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_disagg.nanoflow.auto import break_even_tokens
from vllm_disagg.nanoflow.autosearch import SEARCH_LAYERS, SearchResult, fast_sizes, nano_combos, search
from vllm_disagg.nanoflow.graph import ATTN, DENSE, NET
from vllm_disagg.nanoflow.plan import NanoBatchCounts, NanoFlowPlan, default_plan_path

CPU_SERIAL_UNITS = (DENSE, ATTN)
"""The profile is measured on CPU, where the executor serialises these units (CPU_KERNEL_LOCK)."""

if TYPE_CHECKING:  # torch-importing modules load lazily: `vllm-disagg --help` stays fast
    from vllm_disagg.nanoflow.profiler import OpProfile

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="profile ops and search a NanoFlow nano-batch plan")
    p.add_argument("--model", required=True, help="model directory (or config.json) to profile")
    p.add_argument("--out", help="plan path (default: where num_nano_batches=auto looks)")
    p.add_argument("--max-tokens", type=int, default=512, help="largest dense batch to consider")
    p.add_argument("--context-len", type=int, default=256, help="KV tokens per request for decode attention")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (adds all-reduce ops)")
    p.add_argument("--net-gbps", type=float, default=5.0, help="all-reduce bandwidth, GB/s (modelled)")
    p.add_argument("--remote-rpc-us", type=float, default=0.0, help="remote attention round trip; 0 = local")
    p.add_argument("--max-nano-batches", type=int, default=8)
    p.add_argument("--min-nano-batches", type=int, default=1, help="2 forces nano-batching on")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="coarse grid (a few seconds)")
    p.set_defaults(func=run_tune)
    return p


def token_grid(max_tokens: int, quick: bool) -> list[int]:
    grid, t = [], 8 if not quick else 16
    while t <= max_tokens:
        grid.append(t)
        t *= 2 if quick else 1
        if not quick:
            t = int(t * 1.5) if t < 64 else t + 64 if t < 512 else t + 256
    return sorted(set(grid + [max_tokens]))


def tune(args: argparse.Namespace) -> tuple[NanoFlowPlan, SearchResult, OpProfile]:
    from tqdm import tqdm

    from vllm_disagg.nanoflow.profiler import ModelShape, NetModel, dense_seconds, profile_ops
    from vllm_disagg.nanoflow.units import allowed_cores

    t0 = time.perf_counter()
    shape = ModelShape.from_hf_config(args.model)
    cores = allowed_cores()
    sizes = token_grid(args.max_tokens, args.quick)
    net = NetModel(gbytes_per_s=args.net_gbps, rpc_s=args.remote_rpc_us * 1e-6, tp=args.tp)
    with tqdm(total=len(sizes) * len(cores), desc="profile ops", unit="size") as bar:
        prof = profile_ops(shape, sizes, None, args.context_len, args.reps, net, progress=bar.update)
    dense = {t: dense_seconds(prof, t, len(cores)) for t in sizes}
    fast = fast_sizes(dense)
    batches = fast[-3:]
    combos = nano_combos(args.max_nano_batches, args.min_nano_batches)
    with tqdm(total=len(batches) * len(combos), desc="search plans", unit="cand") as bar:
        result = search(
            prof.cost,
            shape.num_layers,
            batches,
            len(cores),
            combos,
            tensor_parallel=args.tp > 1,
            attention_remote=args.remote_rpc_us > 0,
            progress=bar.update,
            serial=CPU_SERIAL_UNITS,  # profiled on CPU: dense and attention kernels cannot overlap
        )
    plan = plan_from(result, prof, fast, args, time.perf_counter() - t0)
    return plan, result, prof


def plan_from(result: SearchResult, prof: OpProfile, fast: list[int], args, seconds: float) -> NanoFlowPlan:
    from vllm_disagg.nanoflow.profiler import peak_flops
    from vllm_disagg.nanoflow.units import allowed_cores

    best = result.best
    shares = dict(best.shares)
    if not best.inline and (args.tp > 1 or args.remote_rpc_us > 0):
        shares.setdefault(NET, 0)
    at_share = {
        op: shares.get(ATTN if op == "attn" else DENSE, max(shares.values()))
        for op in ("kqv", "attn", "o", "ugd")
    }
    costs = {
        op: {str(t): prof.cost(op, t, s) for t in sorted(prof.seconds[op][max(prof.seconds[op])])}
        for op, s in at_share.items()
    }
    break_even = break_even_tokens(
        prof.cost, min(prof.shape.num_layers if prof.shape else SEARCH_LAYERS, SEARCH_LAYERS), best.num_attn_batches, best.num_dense_batches, dict(best.shares),
        token_grid(args.max_tokens, args.quick), inline=best.inline, tensor_parallel=args.tp > 1,
        attention_remote=args.remote_rpc_us > 0, serial=CPU_SERIAL_UNITS,
    )
    if args.min_nano_batches >= 2:  # forced on: every step with enough tokens is split
        break_even = None
    elif best.num_attn_batches >= 2 and break_even is None:  # split only where the model says so: never, then
        best = _whole_step(result, best)
    return NanoFlowPlan(
        nano_batches=NanoBatchCounts(attn=best.num_attn_batches, dense=best.num_dense_batches),
        units={} if best.inline else shares,
        threaded=not best.inline,
        dense_batch_size=best.dense_batch,
        break_even_tokens=break_even,
        fast_sizes=fast,
        op_cost_s=costs,
        predicted_step_s=best.step_s,
        predicted_tokens_per_s=best.tokens_per_s,
        peak_flops=peak_flops(prof, len(allowed_cores())),
        model=str(args.model),
        device=f"cpu x{len(allowed_cores())}",
        search={
            "seconds": round(seconds, 2),
            "candidates": len(result.candidates),
            "network_ops": "modelled (latency + bytes/bandwidth), not profiled",
            "top": [
                {
                    "dense_batch": c.dense_batch,
                    "n_attn": c.num_attn_batches,
                    "n_dense": c.num_dense_batches,
                    "inline": c.inline,
                    "shares": c.shares,
                    "tokens_per_s": round(c.tokens_per_s, 1),
                }
                for c in sorted(result.candidates, key=lambda c: -c.tokens_per_s)[:5]
            ],
        },
    )


def _whole_step(result: SearchResult, best):
    """The best n=1 candidate at `best`'s dense batch (the search always lets n=1 compete)."""
    ones = [c for c in result.candidates if c.num_attn_batches == 1 and c.dense_batch == best.dense_batch]
    return min(ones, key=lambda c: c.step_s) if ones else best


def run_tune(args: argparse.Namespace) -> int:
    plan, _result, _prof = tune(args)
    out = Path(args.out) if args.out else default_plan_path(str(args.model))
    plan.save(out)
    summary = {
        "plan": str(out),
        "nano_batches": plan.nano_batches.model_dump(),
        "units": plan.units or "inline",
        "dense_batch_size": plan.dense_batch_size,
        "break_even_tokens": plan.break_even_tokens,
        "predicted_tokens_per_s": round(plan.predicted_tokens_per_s or 0, 1),
        "search_seconds": plan.search["seconds"],
        "hint": f"--max-num-batched-tokens {plan.dense_batch_size}",
    }
    print(json.dumps(summary))
    return 0
