# SPDX-License-Identifier: Apache-2.0
"""Calibration check: simulate a measured 1P+1D run and compare its percentiles.

The profile's curves (`prefill`, `decode`, `kv_transfer`) come from isolated
measurements (single prompts, fixed decode batches). Its `measured` block is a
separate workload: fixed prompt/output lengths at a Poisson rate, with the
arrival times actually used (`arrivals_s`). The simulator replays exactly those
arrivals on one prompt and one token machine, through the same router policy
and batching code as every other simulation, and the predicted TTFT/TBT
percentiles are compared with the measured ones. Nothing from the validation
workload feeds the model. More: README.md, "calibrate.py".
"""

from __future__ import annotations

import numpy as np

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec
from vllm_disagg.planner.machine import SimMachine, SimRequest
from vllm_disagg.planner.perf_model import PROMPT_TOKEN_CAP, build_perf_model
from vllm_disagg.planner.profile import parse_profile
from vllm_disagg.planner.slo import slo_report
from vllm_disagg.planner.splitwise_sim import MachineGroup, SimOptions, kv_capacity_tokens, simulate
from vllm_disagg.planner.traces import TraceRequest
from vllm_disagg.router.policy import Pool, SchedulerConfig

METRICS = ("ttft", "tbt")
QUANTILES = (50, 90)
REQUIRED = ("rps", "prompt_tokens", "output_tokens")


def measured_machine(machine: dict, model: ModelSpec) -> HardwareSpec:
    """A HardwareSpec whose memory holds exactly the measured KV capacity."""
    kv_tokens = machine.get("kv_capacity_tokens", 1_000_000)
    mem_gb = (model.weight_bytes + kv_tokens * model.kv_bytes_per_token / 0.9) / 1e9
    return HardwareSpec("measured", 1.0, 1.0, mem_gb, nic_gbps=machine.get("nic_gbps", 80.0),
                        kv_layerwise_overhead_ms=machine.get("kv_layerwise_overhead_ms", 0.0))


def measured_trace(meas: dict, seed: int = 0) -> list[TraceRequest]:
    """The validation workload: recorded arrivals if present, else Poisson at `rps`."""
    if meas.get("arrivals_s"):
        arrivals = [float(t) for t in meas["arrivals_s"]]
    else:
        n = int(meas.get("num_requests", 64))
        gaps = np.random.default_rng(seed).exponential(1.0 / meas["rps"], size=n)
        arrivals = list(np.cumsum(gaps))
    p, o = int(meas["prompt_tokens"]), int(meas["output_tokens"])
    return [TraceRequest(f"m{i}", t, p, o) for i, t in enumerate(arrivals)]


def sim_options(machine: dict) -> SimOptions:
    """The router's defaults (1P+1D), the measured chunk budget and first-token rule."""
    return SimOptions(SchedulerConfig(),
                      layerwise_min_tokens=int(machine.get("layerwise_min_tokens", 0)),
                      prompt_token_cap=int(machine.get("max_num_batched_tokens", PROMPT_TOKEN_CAP)),
                      chunked_prefill=bool(machine.get("chunked_prefill", True)),
                      shared_host=bool(machine.get("shared_host", False)),
                      first_token_on_decode=machine.get("first_token_on", "decode") == "decode")


def validate(model: ModelSpec, raw: dict, seed: int = 0) -> dict:
    """Predicted vs measured P50/P90 TTFT and TBT (ms) and the relative errors."""
    meas = raw.get("measured") or {}
    missing = [k for k in REQUIRED if k not in meas]
    if missing:
        raise ValueError(f"profile 'measured' block lacks {missing}")
    prof = parse_profile(raw)
    machine = raw.get("machine") or {}
    hw = measured_machine(machine, model)
    trace = measured_trace(meas, seed)
    groups = [MachineGroup(hw, Pool.PREFILL, 1), MachineGroup(hw, Pool.DECODE, 1)]
    result = simulate(model, groups, trace, sim_options(machine), prof)
    lat = slo_report(result.requests, build_perf_model(model, hw, prof)).latency_ms
    predicted = {f"{m}_ms_p{q}": lat[m][q] for m in METRICS for q in QUANTILES}
    measured = {k: meas[k] for k in predicted if meas.get(k)}
    return {"predicted": {k: predicted[k] for k in (measured or predicted)},
            "measured": measured,
            "relative_error": {k: (predicted[k] - v) / v for k, v in measured.items()},
            "num_requests": len(trace), "num_unfinished": result.num_unfinished,
            "per_request": _per_request(result.requests),
            **_decode_given_first_tokens(model, prof, hw, meas, measured)}


def _decode_given_first_tokens(model: ModelSpec, prof, hw: HardwareSpec, meas: dict, measured: dict) -> dict:
    """When the measurement has each request's first-token time (`first_token_s`, seconds from the
    same origin as `arrivals_s`): D alone, each request joining its running batch at its measured
    first token. The TBT this predicts uses the measured P and handoff timing, so it separates D's
    own model error from TTFT errors that change who decodes together."""
    firsts = meas.get("first_token_s")
    if not firsts:
        return {}
    perf = build_perf_model(model, hw, prof)
    d = SimMachine("d", perf, kv_capacity_tokens(model, hw))
    trace = measured_trace(meas)
    if len(firsts) != len(trace):
        raise ValueError(f"measured first_token_s has {len(firsts)} entries, arrivals {len(trace)}")
    pending = sorted(((float(t), SimRequest(tr, num_generated=1, first_token_s=float(t)))
                      for t, tr in zip(firsts, trace) if tr.num_output_tokens > 1),
                     key=lambda x: x[0], reverse=True)  # pop() takes the earliest
    now, done = 0.0, []
    while pending or d.has_work():
        while pending and pending[-1][0] <= now:
            d.decode_waiting.append(pending.pop()[1])
        batch = d.next_batch()
        if batch is None:
            now = pending[-1][0]
            continue
        now += batch.duration_s
        for req in batch.decodes:
            req.num_generated += 1
            if req.finished:
                d.finish_decode(req)
                req.done_s = now
                done.append(req)
    tbt = [1e3 * (r.done_s - r.first_token_s) / (r.trace.num_output_tokens - 1) for r in done]
    if not tbt:  # one-token requests have no TBT
        return {}
    pred = {f"tbt_ms_p{q}": float(np.percentile(tbt, q)) for q in QUANTILES}
    return {"decode_given_first_tokens": {
        "predicted": pred,
        "relative_error": {k: (pred[k] - v) / v for k, v in measured.items() if k in pred}}}


def _per_request(requests) -> list[dict]:
    """Simulated TTFT and TBT of each request (ms), in trace order, for plots."""
    out = []
    for r in requests:
        if r.first_token_s is None or r.done_s is None:
            continue
        n = r.trace.num_output_tokens
        tbt = (r.done_s - r.first_token_s) / (n - 1) if n > 1 else 0.0
        out.append({"ttft_ms": 1e3 * (r.first_token_s - r.trace.arrival_s), "tbt_ms": 1e3 * tbt})
    return out
