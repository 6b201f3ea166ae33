# SPDX-License-Identifier: Apache-2.0
"""Where the planner's TBT error comes from (issue 14, `planner_max_error`): D's step model, or the batch.

For each ours_tcp replay of a serve_bench run it rebuilds, from the client's own record (send time from
the trace, TTFT and every inter-token gap), which requests were decoding together at every gap, and
compares each measured gap with the profile's step time for that batch and context. The same is done
on the simulator's token times for the same window. Gaps are also split by what else was going on:
a request in P's hands (prefill, its KV landing on D), a request joining D's batch, or neither.

    python benchmarks/serve_step_diag.py RESULT.json WORK_DIR [--out results/serve_step_diag.json]

WORK_DIR is the run's `serve-bench-*` folder (client results and traces), printed at its start.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np

from vllm_disagg.models import launch_model
from vllm_disagg.planner.calibrate import measured_machine, sim_options
from vllm_disagg.planner.catalog import ModelSpec
from vllm_disagg.planner.perf_model import build_perf_model
from vllm_disagg.planner.profile import parse_profile
from vllm_disagg.planner.splitwise_sim import MachineGroup, simulate
from vllm_disagg.planner.traces import TraceRequest
from vllm_disagg.router.policy import Pool

DEPLOYMENT = "ours_tcp"


def token_times(arrival_s: float, ttft_s: float, gaps_s: list[float]) -> list[float]:
    out = [arrival_s + ttft_s]
    for gap in gaps_s:
        out.append(out[-1] + gap)
    return out


def gap_rows(requests: list[tuple[int, list[float]]], perf) -> list[dict]:
    """Every gap of every request: the batch decoding at its middle, their context, gap / model."""
    spans = [(times[0], times[-1], num_prompt, times) for num_prompt, times in requests if len(times) > 1]
    firsts = [times[0] for _, times in requests if times]
    rows = []
    for _, times in requests:
        for k in range(1, len(times)):
            lo, hi = times[k - 1], times[k]
            mid = 0.5 * (lo + hi)
            live = [(n, t) for s, e, n, t in spans if s <= mid <= e]
            context = sum(n + int(np.searchsorted(t, mid)) for n, t in live)
            model_s = perf.decode_ms(max(1, len(live)), context) / 1e3
            rows.append({"batch": len(live), "gap_s": hi - lo, "ratio": (hi - lo) / model_s,
                         "joins": any(lo < f <= hi for f in firsts)})  # own first token is before lo
    return rows


def _summary(rows: list[dict]) -> dict:
    ratio = [r["ratio"] for r in rows]
    return {"num_gaps": len(rows), "batch_mean": round(float(np.mean([r["batch"] for r in rows])), 2),
            "gap_p50_ms": round(1e3 * float(np.median([r["gap_s"] for r in rows])), 1),
            "gap_p99_ms": round(1e3 * float(np.percentile([r["gap_s"] for r in rows], 99)), 1),
            "gap_over_model_p50": round(float(np.median(ratio)), 3),
            "gap_over_model_p90": round(float(np.percentile(ratio, 90)), 3)}


def _find_trace(work: Path, rate: float, num: int) -> list[dict]:
    for path in sorted(work.glob("trace_*.jsonl")):
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        span = lines[-1]["timestamp"] - lines[0]["timestamp"] if len(lines) == num else 0
        if span > 0 and abs((num - 1) / span - rate) / rate < 0.35:
            return lines
    raise SystemExit(f"no trace of {num} requests at {rate} req/s in {work}")


def diagnose(result: dict, work: Path) -> list[dict]:
    model_dir = launch_model("smollm2-135m")
    model = ModelSpec.from_hf_config(Path(model_dir) / "config.json", name="smollm2-135m")
    raw = result["prediction"]["profiles"][DEPLOYMENT]
    prof, machine = parse_profile(raw), raw.get("machine") or {}
    hw = measured_machine(machine, model)
    perf = build_perf_model(model, hw, prof)
    out = []
    for path in sorted(glob.glob(str(work / f"{DEPLOYMENT}_*.json"))):
        res = json.loads(Path(path).read_text())
        rate, num = float(Path(path).stem.rsplit("_", 1)[1]), len(res["ttfts"])
        trace = _find_trace(work, rate, num)
        arrivals = [t["timestamp"] - trace[0]["timestamp"] for t in trace]
        served = [i for i in range(num) if res["ttfts"][i]]  # a failed request has no token times
        measured = [(res["input_lens"][i], token_times(arrivals[i], res["ttfts"][i], res["itls"][i])) for i in served]
        window = [TraceRequest(f"r{i}", arrivals[i], res["input_lens"][i], res["output_lens"][i]) for i in range(num)]
        groups = [MachineGroup(hw, Pool.PREFILL, 1), MachineGroup(hw, Pool.DECODE, 1)]
        sim = simulate(model, groups, window, sim_options(machine), prof)
        simulated = [(r.trace.num_prompt_tokens, r.token_times_s) for r in sim.requests if r.token_times_s]
        rows = gap_rows(measured, perf)
        in_p = [any(arrivals[i] <= 0.5 * (r0 + r1) < t[0] for i, (_, t) in zip(served, measured, strict=True))
                for _, times in measured for r0, r1 in zip(times, times[1:], strict=False)]
        split = {"joins_d": [r for r in rows if r["joins"]],
                 "request_in_p": [r for r, p in zip(rows, in_p, strict=True) if p and not r["joins"]],
                 "neither": [r for r, p in zip(rows, in_p, strict=True) if not p and not r["joins"]]}
        out.append({"run": Path(path).stem, "rate": rate, "measured": _summary(rows),
                     "simulated": _summary(gap_rows(simulated, perf)),
                     "measured_by_cause": {k: _summary(v) for k, v in split.items() if v}})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = diagnose(json.loads(args.result.read_text()), args.work)
    text = json.dumps(rows, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
