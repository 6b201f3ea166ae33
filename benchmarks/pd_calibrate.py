# SPDX-License-Identifier: Apache-2.0
"""Planner calibration on the real CPU 1P+1D deployment (issue 6): fit, then predict an unseen load.

One deployment (pd_common.py's: SmolLM2-135M shape, dummy weights, pd_common.DTYPE, the router in this process).
Every thread of P's processes (API server, EngineCore, Worker) is bound to P's core, every thread of
D's and of this harness to D's core (vLLM binds only the Worker's compute threads; its EngineCore
spin-waits on the Worker and would float onto P's core). Three measurements:
(a) prefill points: single requests at several prompt lengths through the router, one at a time;
    P's engine prefill time (`vllm:request_prefill_time_seconds`) is the curve, the full push time
    and its exposed part feed the KV model, TTFT is kept to check the no-load residual. Then batched
    points: k 512-token prompts queued on P behind a busy step, which vLLM's scheduler runs as one
    step (k x 512 <= max_num_batched_tokens), as bursts do in (c).
(b) decode points (pd_decode.py): B requests sent straight to D (local prefill there), the inter-token
    gaps while all B are decoding together = D's iteration time at batch B and that context.
(c) validation: fixed prompt/output lengths at a fixed Poisson rate through the router; per-request
    TTFT and TBT (a request's mean gap, Splitwise's definition), P50/P90, and the arrival times used.
Diagnostics (not fitted on): the 512-token prefill probe again after (c) (box drift); TBT of
requests alternately straight to D and through the router (what the P/D path adds to decode); P's
prefill with D decoding vs idle and D's gaps with P prefilling vs idle (cross interference); per
phase, the CPU seconds of every thread of P, D and the harness and each core's busy time (`others`
= other tenants: the errors only describe the model when that is ~0).
The planner's perf model is fitted from (a)+(b) only; `vllm_disagg.planner.calibrate.validate`
replays (c)'s arrivals through the simulator (same router policy and batching code) and reports
predicted vs measured percentiles and their relative errors.

    python benchmarks/pd_calibrate.py --quick   # < 5 min, one JSON object on stdout
    python benchmarks/pd_calibrate.py           # more points, longer validation
    python benchmarks/pd_calibrate.py --quick --no-pin   # vLLM's own binding only (*_nopin files)
Writes results/pd_profile_calib{_quick}.json (the profile: `vllm-disagg plan splitwise --profile ...
--validate` re-runs the comparison), results/pd_calibrate{_quick}.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from cpu_account import CpuAccount, cpu_shares, p_cpu_ms_per_request, p_main_thread  # noqa: E402
from pd_common import (  # noqa: E402
    DTYPE,
    RESULTS,
    SMOLLM2_SHAPE,
    log,
    metrics,
    pd_specs,
    phase,
    prompt,
    start_router,
    stream,
)
from pd_decode import decode_points, running_stream, step_jitter  # noqa: E402

from vllm_disagg.planner.calibrate import validate  # noqa: E402
from vllm_disagg.planner.catalog import ModelSpec  # noqa: E402

PLAN = {
    True: {"prefill_sizes": [128, 512, 2048], "prefill_reps": 3, "batched_prompts": [2, 4], "batched_reps": 2,
           "decode_batches": [1, 4, 12],
           "decode_contexts": [128, 512], "decode_tokens": 20, "decode_reps": 3, "val_requests": 30,
           "val_max_s": 90.0, "cross_reps": 2},
    False: {"prefill_sizes": [128, 256, 512, 1024, 2048], "prefill_reps": 3, "batched_prompts": [2, 3, 4],
            "batched_reps": 3,
            "decode_batches": [1, 2, 4, 8, 16, 24], "decode_contexts": [128, 512, 1024],
            "decode_tokens": 32, "decode_reps": 3, "val_requests": 80, "val_max_s": 240.0, "cross_reps": 4},
}


# ------------------------------------------------------------- (a) prefill
async def prefill_points(session, router_url: str, p_url: str, sizes: list[int], reps: int) -> list[dict]:
    """One request at a time, P's metrics read around each, the sizes in interleaved rounds (a slow
    stretch of a shared box lands on one rep of several sizes, not on every rep of one: stop 48's
    third bisection had plain's 1024-token point 25 % high after three back-to-back reps), medians
    per size: P's engine prefill, push time and its exposed part, TTFT."""
    rngs = {n: random.Random(n) for n in sizes}
    reqs: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            before = await metrics(session, p_url)
            out = await stream(session, router_url, {"prompt": prompt(n, rngs[n]), "max_tokens": 2})
            await asyncio.sleep(1.2)  # stats reach P's frontend with the next engine step / log interval
            after = await metrics(session, p_url)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _PROBE}
            reqs[n].append({"ttft_ms": 1e3 * out["times"][0], **{k: 1e3 * v for k, v in delta.items()}})
    return [_prefill_row(n, reqs[n]) for n in sizes]


def _prefill_row(n: int, reqs: list[dict]) -> dict:
    pushed = [r for r in reqs if r[_PROBE[3]] > 0] or [None]  # push stats may lag a slow box
    med = {k: statistics.median(r[k] for r in reqs) for k in ("ttft_ms", _PROBE[0])}
    med |= {k: statistics.median(r[k] for r in pushed) if pushed[0] else None for k in _PROBE[1:3]}
    row = {"num_tokens": n, "prefill_ms": med[_PROBE[0]], "transfer_ms": med[_PROBE[1]],
           "exposed_ms": med[_PROBE[2]], "ttft_ms": med["ttft_ms"], "reps": reqs}
    log(f"prefill { {k: v for k, v in row.items() if k != 'reps'} }")
    return row


async def batched_prefill_points(session, router_url: str, p_url: str, n: int, counts: list[int], reps: int,
                                 single_ms: float) -> list[dict]:
    """k prompts of n tokens sent while P prefills a blocker of n tokens: all k wait, and vLLM's scheduler
    puts them into P's next step (k*n <= max_num_batched_tokens), as a burst does in (c); the engine's
    step counter checks that it was 2 steps. The step's time is the first-token gap between the batch and
    the blocker (both end the same way: exposed push + one D iteration). Cross-check: each queued request's
    engine prefill time is that step, so (sum of prefill times - the blocker's) / k, with the blocker's
    taken as the single-prompt point (on a busy box that point's noise lands here, hence not the fit)."""
    rows = []
    for k in counts:
        rng = random.Random(1000 + k)
        reps_rows = []
        for _ in range(reps):
            before = await metrics(session, p_url)
            blocker = asyncio.create_task(stream(session, router_url, {"prompt": prompt(n, rng), "max_tokens": 2}))
            await asyncio.sleep(min(0.3, single_ms / 4e3))  # the blocker's step is under way on P
            outs = await asyncio.gather(*(stream(session, router_url, {"prompt": prompt(n, rng), "max_tokens": 2})
                                          for _ in range(k)))
            first = await blocker
            await asyncio.sleep(1.2)
            after = await metrics(session, p_url)
            delta = {m: after.get(m, 0.0) - before.get(m, 0.0) for m in _STEP}
            gap = statistics.median(o["t0"] + o["times"][0] for o in outs) - (first["t0"] + first["times"][0])
            reps_rows.append({"step_ms": (1e3 * delta[_STEP[0]] - single_ms) / k, "first_token_gap_ms": 1e3 * gap,
                              "num_steps": round(delta[_STEP[2]]), "num_requests": round(delta[_STEP[1]])})
        good = [r for r in reps_rows if r["num_steps"] == 2 and r["num_requests"] == k + 1]
        use = good or reps_rows  # none confirmed (counter missing?): keep all, flagged by num_one_step_reps
        rows.append({"num_prompts": k, "num_tokens": n, "ms": statistics.median(r["first_token_gap_ms"] for r in use),
                     "engine_step_ms": statistics.median(r["step_ms"] for r in use),
                     "num_one_step_reps": len(good), "reps": reps_rows})
        log(f"batched prefill { {key: v for key, v in rows[-1].items() if key != 'reps'} }")
    return rows


_STEP = ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
         "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum", "vllm:request_queue_time_seconds_sum")
_PROBE = ("vllm:request_prefill_time_seconds_sum", "vllm:disagg_kv_request_transfer_seconds_sum",
          "vllm:disagg_kv_exposed_transfer_seconds_sum", "vllm:disagg_kv_exposed_transfer_seconds_count")


# ---------------------------------------------------------- (c) validation
async def validation(session, router_url: str, p_url: str, prompt_tokens: int, output_tokens: int,
                     rate: float, num: int, seed: int = 7) -> dict:
    """Poisson arrivals of identical-shape requests; per-request TTFT and mean TBT."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = [prompt(prompt_tokens, rng) for _ in arrivals]
    start = time.perf_counter() + 0.5
    rows: list[dict] = [{} for _ in arrivals]

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        out = await stream(session, router_url, {"prompt": prompts[i], "max_tokens": output_tokens})
        ts = out["times"]
        rows[i] = {"sent_s": out["t0"] - start, "ttft_ms": 1e3 * ts[0],
                   "tbt_ms": 1e3 * (ts[-1] - ts[0]) / max(1, len(ts) - 1), "num_tokens": len(ts)}

    before = await metrics(session, p_url)
    await asyncio.gather(*(one(i) for i in range(num)))
    await asyncio.sleep(1.2)
    after = await metrics(session, p_url)
    p_engine = {m.removeprefix("vllm:"): after.get(m, 0.0) - before.get(m, 0.0) for m in _STEP}
    ttft, tbt = [r["ttft_ms"] for r in rows], [r["tbt_ms"] for r in rows]
    return {"rps": rate, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "num_requests": num,
            "arrivals_s": [r["sent_s"] for r in rows],
            "first_token_s": [r["sent_s"] + r["ttft_ms"] / 1e3 for r in rows],  # D's replay (calibrate.py)
            **{f"ttft_ms_p{q}": _pct(ttft, q) for q in (50, 90)},
            **{f"tbt_ms_p{q}": _pct(tbt, q) for q in (50, 90)}, "requests": rows,
            "p_engine": p_engine}  # diagnostic: P's steps, tokens and prefill/queue seconds during (c)


async def paired_tbt(session, router_url: str, d_url: str, prompt_tokens: int, output_tokens: int,
                     reps: int) -> dict:
    """Diagnostic, not used for fitting: alternate one request straight to D (local prefill, then
    decode alone) with one through the router (P/D push), one at a time, so both see the same box.
    Their per-request TBT differ only by the P/D path (remote KV, router SSE relay)."""
    rng = random.Random(99)
    tbt: dict[str, list[float]] = {"direct_d": [], "via_router": []}
    for _ in range(reps):
        for key, url in (("direct_d", d_url), ("via_router", router_url)):
            ts = (await stream(session, url, {"prompt": prompt(prompt_tokens, rng),
                                               "max_tokens": output_tokens}))["times"]
            tbt[key].append(1e3 * (ts[-1] - ts[0]) / max(1, len(ts) - 1))
    med = {k: statistics.median(v) for k, v in tbt.items()}
    return {"tbt_ms": tbt, "median_ms": med, "router_over_direct": med["via_router"] / med["direct_d"]}


async def cross_interference(session, router_url: str, p_url: str, n: int, reps: int, batch: int = 4) -> dict:
    """Diagnostic, not fitted on: does one instance slow the other down although each has its own core?
    (a) measures P's prefill with D idle and (b) D's iterations with P idle, while in (c) both run at
    once. Interleaved pairs: an n-token probe through the router with D idle, then the same while D
    decodes `batch` routed streams (short prompts, long outputs, their prefills done before the probe).
    P's engine prefill time of the probe, and D's token gaps while the probe's prefill runs vs after it."""
    rng = random.Random(4242)
    rows: dict[str, list[float | None]] = {"prefill_ms_d_idle": [], "prefill_ms_d_decoding": [],
                                    "d_gap_ms_p_idle": [], "d_gap_ms_p_prefilling": []}
    for _ in range(reps):
        rows["prefill_ms_d_idle"].append(await _probe_prefill_ms(session, router_url, p_url, prompt(n, rng)))
        first: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in range(batch)]
        bg_times: list[list[float]] = [[] for _ in range(batch)]
        bg = [asyncio.create_task(running_stream(session, router_url, {"prompt": prompt(32, rng), "max_tokens": 160},
                                                 f, ts)) for f, ts in zip(first, bg_times)]
        await asyncio.wait_for(asyncio.gather(*first), timeout=120)
        await asyncio.sleep(0.8)  # the batch's own prefill stats reach P's frontend first
        t0 = time.perf_counter()
        busy_ms = await _probe_prefill_ms(session, router_url, p_url, prompt(n, rng), settle_s=0.0)
        rows["prefill_ms_d_decoding"].append(busy_ms)
        busy_end = t0 + (busy_ms or 0.0) / 1e3
        await asyncio.gather(*bg)
        for ts in bg_times:
            for a, b in zip(ts, ts[1:]):
                if t0 + 0.05 <= a and b <= busy_end:
                    rows["d_gap_ms_p_prefilling"].append(1e3 * (b - a))
                elif a >= busy_end + 0.3:  # after the probe's KV landed and its first D step
                    rows["d_gap_ms_p_idle"].append(1e3 * (b - a))
        await asyncio.sleep(1.2)
    rows = {k: [x for x in v if x is not None] for k, v in rows.items()}
    med = {k: statistics.median(v) if v else None for k, v in rows.items()}
    return {**{k: [round(x, 2) for x in v] for k, v in rows.items() if k.startswith("prefill")},
            "median_ms": med, "num_gaps": {k: len(v) for k, v in rows.items() if k.startswith("d_gap")},
            "prefill_ratio": _ratio(med["prefill_ms_d_decoding"], med["prefill_ms_d_idle"]),
            "decode_ratio": _ratio(med["d_gap_ms_p_prefilling"], med["d_gap_ms_p_idle"])}


async def _probe_prefill_ms(session, router_url: str, p_url: str, body_prompt: list[int],
                            settle_s: float = 1.2) -> float | None:
    """P's engine prefill time of one request (from P's counters, read around it)."""
    before = await metrics(session, p_url)
    await stream(session, router_url, {"prompt": body_prompt, "max_tokens": 2})
    await asyncio.sleep(max(settle_s, 0.6))  # the stats reach P's frontend with its next step
    after = await metrics(session, p_url)
    count = after.get(_STEP[1], 0.0) - before.get(_STEP[1], 0.0)
    if round(count) != 1:  # another request's stats landed in the window: the sum is not this probe's
        log(f"prefill probe: {count} requests counted in its window, dropped")
        return None
    return 1e3 * (after.get(_PROBE[0], 0.0) - before.get(_PROBE[0], 0.0))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _pct(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q))


# ------------------------------------------------------------- deployment facts
def engine_facts(log_dir: Path) -> dict:
    """max_num_batched_tokens (P) and KV capacity in tokens (D), read from the instances' logs."""
    facts = {}
    p_log = (log_dir / "calib" / "prefill0.log").read_text(errors="replace")
    d_log = (log_dir / "calib" / "decode0.log").read_text(errors="replace")
    if m := re.search(r"max_num_batched_tokens=(\d+)", p_log):
        facts["max_num_batched_tokens"] = int(m.group(1))
    if m := re.search(r"enable_chunked_prefill=(True|False)", p_log):
        facts["chunked_prefill"] = m.group(1) == "True"
    if m := re.search(r"KV cache size: ([\d,]+) tokens", d_log):
        facts["kv_capacity_tokens"] = int(m.group(1).replace(",", ""))
    return facts


def build_profile(pre: list[dict], dec: list[dict], val: dict, facts: dict, batched: list[dict]) -> dict:
    """The planner profile: curves from (a)+(b), the validation workload as `measured`."""
    machine = {"kv_capacity_tokens": facts.get("kv_capacity_tokens", (384 << 20) // 23040),
               # vLLM 0.32's CPU default for `vllm serve` (arg_utils.get_batch_defaults); P does not log it
               "max_num_batched_tokens": facts.get("max_num_batched_tokens", 2048),
               "chunked_prefill": facts.get("chunked_prefill", True),
               "layerwise_min_tokens": 0, "first_token_on": "decode",
               "kv_layerwise_overhead_ms": statistics.median(r["exposed_ms"] for r in pre if r["exposed_ms"] is not None)}
    measured = {k: v for k, v in val.items() if k not in ("requests", "p_engine")}
    jitter = step_jitter(dec)
    return {"schema": "vllm-disagg-profile/1", "device": f"cpu x{os.cpu_count()} (1 core per instance)",
            "model": f"smollm2-135m (dummy weights, {DTYPE})",
            # Splitwise's form: a step costs the curve at its batch tokens, the batched points included
            # (this CPU: 2 x 512 costs the curve at 1024, 4 x 512 about one 2048-token prompt; the
            # quadratic a + b*T + c*sum(n^2) + d*T^2 missed the single 512-token point by -15 %)
            "prefill_fit": "piecewise",
            "prefill": [{"num_tokens": r["num_tokens"], "ms": r["prefill_ms"]} for r in pre],
            "prefill_batched": [{k: r[k] for k in ("num_prompts", "num_tokens", "ms")} for r in batched],
            "decode": dec,
            "kv_transfer": [{"num_tokens": r["num_tokens"], "ms": r["transfer_ms"]} for r in pre
                            if r["transfer_ms"] is not None],
            "machine": machine, "measured": measured, **({"step_jitter": jitter} if jitter else {})}


# ------------------------------------------------------------------- main
async def run(quick: bool, model_dir: Path, log_dir: Path, load: float, pin: bool = True) -> dict:
    plan = PLAN[quick]
    out: dict = {"quick": quick, "load1_start": os.getloadavg()[0], "plan": plan}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async with phase("calib", pd_specs(), model_dir, log_dir) as (p, d):
            router = await start_router(p, d)
            try:
                await stream(session, router.url, {"prompt": [5] * 300, "max_tokens": 2})  # warm up
                cpu = CpuAccount(p.http_port, d.http_port)
                # P's whole tree on P's core; D's and this harness (router + client, < 1 % of a core) on D's
                p_core, d_core = ({int(c) for c in spec.cores.split(",")} for spec in (p, d))
                out["pinned"] = cpu.pin({"P": p_core, "D": d_core, "harness": d_core}) if pin else None
                cpu.mark("prefill")
                pre = await prefill_points(session, router.url, p.url, plan["prefill_sizes"], plan["prefill_reps"])
                single = next(r["prefill_ms"] for r in pre if r["num_tokens"] == 512)
                cpu.mark("prefill_batched")
                bat = await batched_prefill_points(session, router.url, p.url, 512, plan["batched_prompts"],
                                                   plan["batched_reps"], single)
                cpu.mark("decode")
                dec = await decode_points(session, d.url, plan["decode_batches"], plan["decode_contexts"],
                                          plan["decode_tokens"], plan["decode_reps"])
                p_len, o_len = 512, 24
                t_pre = next(r["prefill_ms"] for r in pre if r["num_tokens"] == p_len) / 1e3
                rate = round(load / t_pre, 3)  # P's offered load from its own measured prefill time
                num = max(12, min(plan["val_requests"], int(rate * plan["val_max_s"])))
                log(f"validation: {num} x ({p_len} in, {o_len} out) at {rate}/s")
                cpu.mark("validation")
                val = await validation(session, router.url, p.url, p_len, o_len, rate, num)
                # the same probe after (c): a changed box (other tenants) shows here, not in the error
                cpu.mark("prefill_after")
                after = await prefill_points(session, router.url, p.url, [p_len], plan["prefill_reps"])
                cpu.mark("paired_tbt")
                paired = await paired_tbt(session, router.url, d.url, p_len, o_len, plan["prefill_reps"])
                log(f"paired TBT {paired['median_ms']}")
                cpu.mark("cross_interference")
                cross = await cross_interference(session, router.url, p.url, p_len, plan["cross_reps"])
                log(f"cross interference {cross['median_ms']}")
                cpu.mark("end")
            finally:
                await router.stop()
    out.update(prefill=pre, prefill_batched=bat, decode=dec, validation=val, facts=engine_facts(log_dir), prefill_after=after,
               paired_tbt=paired, cross_interference=cross, cpu=cpu.phases(),
               load1_end=os.getloadavg()[0])
    return out


def compare(raw: dict, model_dir: Path) -> dict:
    profile = build_profile(raw["prefill"], raw["decode"], raw["validation"], raw["facts"],
                            raw.get("prefill_batched", []))
    model = ModelSpec.from_hf_config(model_dir / "config.json", name="smollm2-135m")
    cmp = validate(model, profile)
    residual = [r["ttft_ms"] - r["prefill_ms"] - (r["exposed_ms"] or 0.0) for r in raw["prefill"]]
    summary = {f"error_{k}": v for k, v in cmp["relative_error"].items()}
    before = next(r["prefill_ms"] for r in raw["prefill"] if r["num_tokens"] == raw["validation"]["prompt_tokens"])
    summary.update(predicted=cmp["predicted"], measured=cmp["measured"],
                   box_drift_prefill_after_over_before=raw["prefill_after"][0]["prefill_ms"] / before,
                   validation_rps=raw["validation"]["rps"], no_load_ttft_residual_ms=residual,
                   paired_tbt_router_over_direct=raw["paired_tbt"]["router_over_direct"],
                   load1_start=raw["load1_start"], load1_end=raw["load1_end"], pinned=raw.get("pinned"),
                   cross_prefill_ratio=raw["cross_interference"]["prefill_ratio"],
                   cross_decode_ratio=raw["cross_interference"]["decode_ratio"],
                   cores_used=cpu_shares(raw["cpu"], (raw.get("pinned") or {}).get("P")),
                   p_cpu_ms_per_request_validation=p_cpu_ms_per_request(raw),
                   p_main_thread_validation=p_main_thread(raw),
                   tbt_error_given_measured_first_tokens=cmp.get("decode_given_first_tokens", {}).get(
                       "relative_error"))
    return {"summary": summary, "profile": profile, "comparison": cmp, "details": raw}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    prof, cmp, raw = result["profile"], result["comparison"], result["details"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.plot([r["num_tokens"] for r in prof["prefill"]], [r["ms"] for r in prof["prefill"]], "o-", label="P prefill")
    a.plot([r["num_tokens"] for r in raw["prefill"]], [r["ttft_ms"] for r in raw["prefill"]], "s--", label="TTFT")
    for r in prof.get("prefill_batched", []):
        a.plot(r["num_prompts"] * r["num_tokens"], r["ms"], "^", color="C2")
        a.annotate(f"{r['num_prompts']}x{r['num_tokens']}", (r["num_prompts"] * r["num_tokens"], r["ms"]))
    a.set(xlabel="prompt tokens", ylabel="ms", title="(a) single prompts")
    a.legend()
    for ctx in sorted({r["context_tokens"] for r in prof["decode"]}):
        pts = [r for r in prof["decode"] if r["context_tokens"] == ctx]
        b.plot([r["batch_size"] for r in pts], [r["ms"] for r in pts], "o-", label=f"ctx {ctx}")
    b.set(xlabel="decode batch", ylabel="ms / iteration", title="(b) D iteration time")
    b.legend()
    for key, style in (("ttft_ms", "-"), ("tbt_ms", "--")):
        meas = np.sort([r[key] for r in raw["validation"]["requests"]])
        pred = np.sort([r[key] for r in cmp["per_request"]])
        c.plot(meas, np.linspace(0, 1, len(meas)), style, color="C0", label=f"measured {key[:-3]}")
        c.plot(pred, np.linspace(0, 1, len(pred)), style, color="C1", label=f"simulated {key[:-3]}")
    c.set(xscale="log", xlabel="ms", ylabel="CDF", title=f"(c) {raw['validation']['rps']}/s validation")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="< 5 min; prints one JSON object")
    parser.add_argument("--load", type=float, default=0.4,
                        help="validation: P's busy fraction (offered rate x measured prefill time)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave P's and D's API server and EngineCore unpinned (only the worker's compute "
                             "threads bound, as `vllm-disagg up` does), for comparison")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # run the `finally`s: stop every server
    log_dir = Path(tempfile.mkdtemp(prefix="pd-calib-logs-"))
    log(f"instance logs in {log_dir}")
    with tempfile.TemporaryDirectory(prefix="pd-calib-") as tmp:
        model_dir = make_model(Path(tmp))
        raw = asyncio.run(run(args.quick, model_dir, log_dir, args.load, pin=not args.no_pin))
        result = compare(raw, model_dir)
    suffix = ("_quick" if args.quick else "") + ("_nopin" if args.no_pin else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"pd_profile_calib{suffix}.json").write_text(json.dumps(result["profile"], indent=1))
    (RESULTS / f"pd_calibrate{suffix}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"pd_calibrate{suffix}.png")
    print(json.dumps(result["summary"]))
    return 0


def make_model(tmp: Path) -> Path:
    from vllm_disagg.testing import make_tiny_llama

    return make_tiny_llama(tmp / "model", **SMOLLM2_SHAPE)


if __name__ == "__main__":
    sys.exit(main())
