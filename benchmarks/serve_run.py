# SPDX-License-Identifier: Apache-2.0
"""One measured run of serve_bench.py: `vllm bench serve` replays a timed trace against a running deployment.

Around the client run, every instance's /metrics is read, so each run also says where TTFT went (queue
and prefill on P, the KV handoff, D's wait and first step: vLLM's own per-request histograms, as means)
and whether the KV really moved: bytes pushed (ours) or pulled (NIXL), and prompt tokens D computed
itself instead of receiving them (`recomputes`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
from prometheus_client.parser import text_string_to_metric_families
from serve_deploy import SERVED_NAME, Running, process_trees

from vllm_disagg.launch.local import vllm_serve_prefix
from vllm_disagg.planner.goodput import HEADLINE_SLO, from_bench_detailed, summarize

_KEEP = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:time_to_first_token_seconds",
         "vllm:prompt_tokens_by_source", "vllm:request_prefill_kv_computed_tokens", "vllm:disagg_kv_",
         "vllm:nixl_", "vllm:disagg_router_prefill_latency", "vllm:disagg_router_time_to_first_byte",
         "vllm:num_preemptions", "vllm:request_success", "vllm:disagg_router_requests",
         "vllm:disagg_router_whole_requests")


def log(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def scrape(url: str) -> dict[str, float]:
    """The /metrics samples serve_bench uses, `name{label=value,...}` -> value, summed over engines."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(_KEEP):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def deltas(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, float]]:
    return {role: {k: v - before[role].get(k, 0.0) for k, v in after[role].items()
                   if v - before[role].get(k, 0.0)} for role in after}


def warm_up(run: Running, num_tokens: int) -> None:
    """One request through the deployment's endpoint before anything is measured."""
    body = json.dumps({"model": SERVED_NAME, "prompt": [100 + i % 1000 for i in range(num_tokens)],
                       "max_tokens": 8, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{run.url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        json.loads(resp.read())


def bench_command(url: str, model_dir: str, trace_path: Path, num: int, out_dir: Path, name: str,
                  slo_ms: tuple[float, float]) -> list[str]:
    """vLLM's own client on the same two cores as the servers."""
    vllm = vllm_serve_prefix()[0]
    base = [vllm, "bench", "serve"] if vllm.endswith("vllm") else [vllm, "-m", "vllm.entrypoints.cli.main", "bench",
                                                                     "serve"]
    return ["taskset", "-c", "0,1", *base, "--backend", "openai", "--base-url", url, "--model", SERVED_NAME,
            "--tokenizer", model_dir, "--dataset-name", "timed_trace", "--dataset-path", str(trace_path),
            "--num-prompts", str(num), "--ignore-eos", "--save-result", "--save-detailed",
            "--result-dir", str(out_dir), "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--goodput", f"ttft:{slo_ms[0]:g}", f"tpot:{slo_ms[1]:g}"]


def cpu_snapshot(procs) -> dict[tuple, tuple[float, float]]:
    """(process name, its cores, main thread or not, tid) -> (user s, system s) of every thread of the
    deployment: which thread of which instance used the cores (e.g. a transfer library's polling thread
    beside the compute thread on a one-core instance)."""
    out = {}
    for proc in process_trees(procs):
        try:
            name, cores = proc.name(), ",".join(map(str, proc.cpu_affinity()))
            for t in proc.threads():
                out[(name, cores, t.id == proc.pid, t.id)] = (t.user_time, t.system_time)
        except psutil.Error:
            continue
    return out


def cpu_use(before: dict, after: dict, wall_s: float) -> list[dict]:
    """Cores' worth of CPU per (process, cores, main/other threads) over the run, busiest first."""
    groups: dict[tuple, list[float]] = {}
    for key, (user, system) in after.items():
        u0, s0 = before.get(key, (0.0, 0.0))
        g = groups.setdefault(key[:3], [0.0, 0.0])
        g[0] += user - u0
        g[1] += system - s0
    rows = [{"process": n, "cores": c, "threads": "main" if m else "others", "user": round(u / wall_s, 3),
             "system": round(sy / wall_s, 3)} for (n, c, m), (u, sy) in groups.items() if u + sy > 0.01 * wall_s]
    return sorted(rows, key=lambda r: -(r["user"] + r["system"]))[:12]


def measure(run: Running, model_dir: str, trace_path: Path, num: int, out_dir: Path, name: str,
            timeout_s: float) -> dict:
    """Replay `trace_path` once; the summary, vLLM's own figures, the TTFT breakdown and the KV check."""
    roles = {r: u for r, u in run.instances.items() if r != "state_file"}
    before = {r: scrape(u) for r, u in roles.items()}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    slo = (1e3 * HEADLINE_SLO.ttft_s, 1e3 * HEADLINE_SLO.gap_s)
    cmd = bench_command(run.url, model_dir, trace_path, num, out_dir, f"{name}.json", slo)
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the client seeds prompt tokens with Python's str hash
    cpu_before = cpu_snapshot(run.procs)
    t0 = time.monotonic()
    with open(out_dir / f"{name}.client.log", "wb") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): see {out_dir / f'{name}.client.log'}")
    cpu = cpu_use(cpu_before, cpu_snapshot(run.procs), time.monotonic() - t0)
    time.sleep(2.0)  # engine stats reach the API server's /metrics with the logging interval
    after = {r: scrape(u) for r, u in roles.items()}
    detailed = json.loads((out_dir / f"{name}.json").read_text())
    reqs = from_bench_detailed(detailed)
    out = summarize(reqs, detailed.get("duration"))
    out.update(wall_s=time.monotonic() - t0, load_before=load_before,
               load_after=Path("/proc/loadavg").read_text().split()[:3],
               duration_s=detailed.get("duration"),
               goodput_tpot=detailed["request_goodput"] / detailed["request_throughput"]
               if detailed.get("request_throughput") else None,
               vllm_bench={k: detailed.get(k) for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                                         "median_itl_ms", "p99_itl_ms", "request_goodput")})
    d = deltas(before, after)
    out["engine"] = d
    out["breakdown"] = ttft_breakdown(d, out)
    out["kv"] = kv_check(run, d)
    out["cpu_cores"] = cpu
    return out


def _mean(d: dict, name: str) -> float | None:
    count = d.get(f"{name}_count", 0.0)
    return 1e3 * d.get(f"{name}_sum", 0.0) / count if count else None


def ttft_breakdown(d: dict[str, dict], summary: dict) -> dict:
    """Mean ms per request of each stage, from vLLM's own histograms (queue: waiting to be scheduled;
    prefill: scheduled to first token). For P/D: P's stages, the router's P round trip, D's stages
    (D's queue includes waiting for the KV), and the push (ours: part not hidden behind prefill).
    `*_wait_for_step_ms` is the rest of the engine's TTFT: vLLM's engine core takes new requests only
    between steps and starts its queue clock then, so a request that arrives during another's prefill
    step waits that step out uncounted (plus the frontend's tokenizing and IPC)."""
    out = {"client_ttft_mean_ms": summary.get("ttft_mean_ms"), "client_ttft_p50_ms": summary.get("ttft_p50_ms")}
    for role in ("plain", "prefill", "decode"):
        if role in d:
            for stage, metric in (("queue", "vllm:request_queue_time_seconds"),
                                  ("prefill", "vllm:request_prefill_time_seconds"),
                                  ("engine_ttft", "vllm:time_to_first_token_seconds")):
                out[f"{role}_{stage}_ms"] = _mean(d[role], metric)
            if role != "decode":  # D's arrival precedes P's prefill: its queue already holds that wait
                out[f"{role}_wait_for_step_ms"] = _rest(out, role)
    router = d.get("router", {})
    out["router_prefill_roundtrip_ms"] = _mean(router, "vllm:disagg_router_prefill_latency_seconds")
    pre = d.get("prefill", {})
    out["push_exposed_ms"] = _mean(pre, "vllm:disagg_kv_exposed_transfer_seconds")
    out["push_total_ms"] = _mean(pre, "vllm:disagg_kv_request_transfer_seconds")
    dec = d.get("decode", {})
    nixl = {**pre, **dec}
    out["nixl_xfer_ms"] = _mean(nixl, "vllm:nixl_xfer_time_seconds")
    out["nixl_post_ms"] = _mean(nixl, "vllm:nixl_post_time_seconds")
    # P/D: what the client waited beyond P's wait, queue and prefill and D's first step is the handoff
    # (the KV not hidden behind the prefill, and the hops)
    stages = [out.get(k) for k in ("prefill_wait_for_step_ms", "prefill_queue_ms", "prefill_prefill_ms",
                                   "decode_prefill_ms")]
    if out["client_ttft_mean_ms"] is not None and None not in stages:
        out["handoff_ms"] = out["client_ttft_mean_ms"] - sum(stages)
    if out["push_exposed_ms"] is not None and out.get("prefill_prefill_ms"):
        out["exposed_fraction_of_prefill"] = out["push_exposed_ms"] / out["prefill_prefill_ms"]
    return out


def _rest(out: dict, role: str) -> float | None:
    parts = [out.get(f"{role}_{k}_ms") for k in ("engine_ttft", "queue", "prefill")]
    return None if None in parts else parts[0] - parts[1] - parts[2]


def kv_check(run: Running, d: dict[str, dict]) -> dict | None:
    """Did the KV move? Bytes over the wire, and prompt tokens D computed itself: vLLM counts every
    prompt token by source (`vllm:prompt_tokens_by_source`), so D's `local_compute` tokens are the
    recomputed ones and its `external_kv_transfer` tokens must be every token P computed. (Its
    per-request histogram of computed tokens is no help: under NixlConnector it counts pulled tokens.)"""
    if not run.deployment.is_pd:
        return None
    pre, dec = d.get("prefill", {}), d.get("decode", {})
    p_tokens, d_local, d_external = (_by_source(x, src) for x, src in (
        (pre, "local_compute"), (dec, "local_compute"), (dec, "external_kv_transfer")))
    num = dec.get("vllm:request_success_total", 0.0) or sum(
        v for k, v in dec.items() if k.startswith("vllm:request_success_total"))
    if run.deployment.kind == "ours":
        nbytes = pre.get("vllm:disagg_kv_bytes_pushed_total", 0.0)
        failures = dec.get("vllm:disagg_kv_fallbacks_total", 0.0)
    else:
        nbytes = sum(x.get("vllm:nixl_bytes_transferred_sum", 0.0) for x in (pre, dec))
        failures = sum(x.get(k, 0.0) for x in (pre, dec) for k in ("vllm:nixl_num_failed_transfers_total",
                                                                    "vllm:nixl_num_kv_expired_reqs_total"))
    # the router's Splitwise overflow sends a whole request to one instance when a queue is long: on D
    # that prompt is computed by design, no recompute; on P (the mixed pool) it is no push either
    whole_on = {pool: round(_counter(d.get("router", {}), "vllm:disagg_router_whole_requests_total", f"pool={pool}"))
                for pool in ("decode", "prefill")}
    num_pushed = max(0.0, num - whole_on["decode"])
    # every prompt P computed reached D (a request may compute its last prompt token on D, connector-
    # dependent), unless P served some whole (then P's count holds theirs too)
    not_arrived = 0.0 if whole_on["prefill"] else p_tokens - num_pushed - d_external
    # prompt tokens D computed beyond one per request; with whole routes to D those hold their whole
    # prompts, of sizes unknown here, and the tokens that did not arrive are the evidence instead (an
    # estimate from D's tokens and the mean prompt counted 7 recomputes for 7 long whole prompts)
    extra = d_local - num if not whole_on["decode"] else not_arrived
    recomputes = 0 if extra <= 0 else max(1, round(extra / max(1.0, p_tokens / max(num_pushed, 1.0))))
    tokens_arrived = not_arrived <= 0
    return {"kv_bytes": nbytes, "decode_requests": num, "prefill_prompt_tokens": p_tokens,
            "decode_transferred_tokens": d_external, "decode_local_prompt_tokens": d_local,
            "routed_whole": sum(whole_on.values()), "routed_whole_by_pool": whole_on, "recomputes": recomputes,
            "transfer_failures": failures,
            "verified": nbytes > 0 and recomputes == 0 and not failures and tokens_arrived}


def _by_source(d: dict, source: str) -> float:
    return _counter(d, "vllm:prompt_tokens_by_source_total", f"source={source}")


def _counter(d: dict, name: str, label: str) -> float:
    """A counter's samples with `label`, summed over its other labels (never its `_created` timestamps)."""
    return sum(v for k, v in d.items() if k.startswith(name + "{") and label in k)
