# SPDX-License-Identifier: Apache-2.0
"""Lamina benchmark (issue 15): remote attention against what a user would otherwise run.

Three sections, every ratio against a baseline measured in the same run, on the same two cores:
- `rtt` (lamina_rtt.py): the per-layer exchange's round trip and wire bytes.
- `cores` (lamina_cores.py): decode at batch 32, context 1024 on a medium random Llama (8 layers,
  float32): remote attention (model worker on core 0, attention server on core 1) against plain vLLM
  on both cores, the faster of vLLM's default binding and VLLM_CPU_OMP_THREADS_BIND=0-1 per turn.
  `lamina_vs_plain_equal_cores` = n=2 (ping-pong) / plain; `send_q_early_default_vs_off`: the stock
  remote runner with the defaults over send-Q-early off. Each configuration's step is broken down
  (`lamina_step_breakdown_ms`: vLLM outside the forward, dense, attention, wire, waits, fill/drain).
- `capacity` (lamina_capacity.py): a long-context decode-heavy workload (contexts 2-8k) with plain
  vLLM capped by a small KV space, against the model worker plus an attention server holding several
  times that space (`lamina_kv_capacity_ratio`), and against plain vLLM given both memories
  (`lamina_kv_capacity_ratio_equal_memory`).
Headline ratios are medians of paired runs (turns, or interleaved rounds); the load average is
recorded before and after each section.

    python benchmarks/attn_bench.py --quick            # <= 10 min, every key; results/attn_bench_quick.*
    python benchmarks/attn_bench.py                    # the headline run; results/attn_bench.{json,png}
    python benchmarks/attn_bench.py --sections capacity  # one section, merged into the same JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from bench_probes import load_avg

RESULTS = Path(__file__).parent / "results"
MEDIUM = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, vocab_size=1024)
DECODE_BATCH, DECODE_CONTEXT = 32, 1024
STEPS_PER_TURN = 4
GOALS = {"lamina_vs_plain_equal_cores": 0.95, "lamina_kv_capacity_ratio": 1.5, "send_q_early_default_vs_off": 1.0}
SECTIONS = ("rtt", "cores", "capacity")


# ------------------------------------------------------------------ rtt
def section_rtt(quick: bool) -> dict:
    from lamina_rtt import RTT_GEOM, SPIN_US, measure_rtt, start_servers, stop_servers

    iters = 200 if SMOKE else 2000 if quick else 5000
    servers = start_servers({"none_shm": ("shm", "none", True), "none_tcp": ("tcp", "none", True),
                             "cpu_shm": ("shm", "cpu", True)})
    try:
        transport = {kind: measure_rtt(servers[f"none_{kind}"], kind, iters) for kind in ("shm", "tcp")}
        full = measure_rtt(servers["cpu_shm"], "shm", iters, raw=False)
    finally:
        stop_servers(servers)
    g = RTT_GEOM
    d, group = g["num_heads"] * g["head_size"], g["num_heads"] // g["num_kv_heads"]
    return {
        "rtt_us_shm": round(transport["shm"]["rtt_us"], 1), "rtt_us_tcp": round(transport["tcp"]["rtt_us"], 1),
        "raw_pingpong_us_shm": round(transport["shm"]["raw_pingpong_us"], 1),
        "raw_pingpong_us_tcp": round(transport["tcp"]["raw_pingpong_us"], 1),
        "rtt_full_us_shm": round(full["rtt_us"], 1), "server_kernel_us_shm": round(full["server_kernel_us"], 1),
        "bytes_per_token_per_layer": transport["shm"]["payload_bytes"] / transport["shm"]["batch"],
        "bytes_per_token_per_layer_formula": (2 + 2 / group) * d * 4,
        "rtt_definition": "median client.attend() round trip of one decode layer (LLaMA-8B layer shape, batch 1) "
                          "through the real client and server, the server answering without computing "
                          f"(--kernel none); shm rings spin {SPIN_US:.0f} us then block; both pinned to their "
                          "own cores. rtt_full_* adds vLLM's CPU attention kernel.",
    }


# ------------------------------------------------------------------ cores
def section_cores(quick: bool) -> dict:
    from lamina_cores import make_model, paired, run_equal_cores
    from lamina_rtt import start_servers, stop_servers

    kinds = ["lamina_n2", "lamina_n1", "remote_default", "remote_send_q_early_off"]
    if not quick:
        kinds.append("remote_send_q_early_on")
    model_dir = make_model(MEDIUM["num_hidden_layers"], MEDIUM)
    servers = start_servers({k: ("shm", "cpu", True) for k in kinds}, kv_cache_gib=1.0)
    try:
        res = run_equal_cores(model_dir, DECODE_BATCH, DECODE_CONTEXT, kinds, servers, STEPS_PER_TURN,
                              turns=2 if SMOKE else 6 if quick else 12, vocab=MEDIUM["vocab_size"])
    finally:
        stop_servers(servers)
    cfg = res["configs"]
    out = {
        "lamina_vs_plain_equal_cores": res["paired"]["lamina_n2"],
        "lamina_vs_plain_default_binding": paired(res, "lamina_n2", "plain_default"),
        "lamina_vs_plain_bind_0_1": paired(res, "lamina_n2", "plain_bind_0_1"),
        "send_q_early_default_vs_off": paired(res, "remote_default", "remote_send_q_early_off"),
        "send_q_early_default_resolved": res["remote_default_send_q_early"],
        "send_q_early_on_vs_off": paired(res, "remote_send_q_early_on", "remote_send_q_early_off")
        if "remote_send_q_early_on" in cfg else None,
        "lamina_n2_vs_stock_remote": paired(res, "lamina_n2", "remote_default"),
        "lamina_n2_vs_n1_serial": paired(res, "lamina_n2", "lamina_n1"),
        "stock_remote_vs_plain_equal_cores": res["paired"]["remote_default"],
        "faster_plain_binding": res["faster_plain_binding"],
        "plain_binding_wins": res["plain_binding_wins"],
        f"decode_tokens_per_s_at_{DECODE_BATCH}_ctx{DECODE_CONTEXT}": {
            k: v["decode_tokens_per_s"] for k, v in cfg.items()},
        f"tbt_ms_at_{DECODE_BATCH}_ctx{DECODE_CONTEXT}": {k: v["tbt_ms"] for k, v in cfg.items()},
        "lamina_step_breakdown_ms": {k: v["breakdown_ms"] for k, v in cfg.items()},
        "greedy_tokens_identical_to_plain": res["greedy_tokens_identical_to_plain"],
        "lamina_n2_nanoflow_stats": res["lamina_n2_nanoflow_stats"],
        "cores_definition": "decode steps timed through engine.step() (in-process engines: no API server; "
                            "scheduler, worker and output processing on the engine thread), engines taking "
                            f"turns of {STEPS_PER_TURN} steps after one prefill each; plain_default: one "
                            "OpenMP thread on core 0 (vLLM's default binding, core 1 reserved), plain_bind_0_1: "
                            "two threads over cores 0-1; plain on both cores = the faster per turn; "
                            "remote: model worker on core 0 (1 thread), attention server on core 1 (1 thread); "
                            "ratios = median over turns of the per-turn throughput ratio",
        "cores_model": MEDIUM, "cores_block_size": 128, "cores_turns": res["turn_medians"],
    }
    return out


# ------------------------------------------------------------------ capacity
def capacity_plan(quick: bool, kv_token: int) -> dict:
    """Workload and KV sizes: plain's space holds about 3 requests of the mean context, the
    attention server 6 times that, equal memory 7 times."""
    from vllm_disagg.testing.workloads import long_context_requests

    # quick: 3 paired rounds of a shorter decode (a headline is a median of >= 3 paired runs)
    num, lo, hi, out_len, rounds = (12, 2048, 4096, 32, 3) if quick else (16, 2048, 8192, 128, 3)
    if SMOKE:
        num, lo, hi, out_len, rounds = 6, 256, 512, 16, 1
    requests = long_context_requests(num, lo, hi, out_len, vocab=1024, seed=15)
    mean_ctx = statistics.fmean(r.context for r in requests)
    block = 128 * kv_token
    plain = math.ceil(3 * mean_ctx * kv_token / block) * block
    return {"requests": requests, "plain_kv_bytes": plain, "server_factor": 6, "rounds": rounds,
            "workload": {"num_requests": num, "min_context": lo, "max_context": hi, "output_len": out_len,
                         "mean_context": round(mean_ctx), "kv_bytes_per_token": kv_token}}


def section_capacity(quick: bool, plain_placement: tuple[set[int], int]) -> dict:
    from lamina_capacity import CAPACITY_MODEL, Run, kv_per_token, ratio, run_capacity
    from lamina_cores import make_model
    from lamina_rtt import TOKEN

    plan = capacity_plan(quick, kv_per_token(CAPACITY_MODEL))
    x, k = plan["plain_kv_bytes"], plan["server_factor"]
    runs = [Run("plain_capped", "plain", x), Run("lamina", "lamina", k * x),
            Run("plain_equal_memory", "plain", (k + 1) * x)]
    extra = [] if quick else [Run("plain_2x", "plain", 2 * x), Run("lamina_2x", "lamina", 2 * x)]
    model_dir = make_model(CAPACITY_MODEL["num_hidden_layers"], CAPACITY_MODEL)
    by = run_capacity(model_dir, plan["requests"], runs, plan["rounds"], extra, plain_placement, TOKEN)

    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in by[name]), 2)

    points = [{"name": n, "kind": rs[0]["kind"], "kv_gib": rs[0]["kv_gib"],
               "decode_tokens_per_s": med(n, "decode_tokens_per_s"),
               "end_to_end_output_tokens_per_s": med(n, "end_to_end_output_tokens_per_s"),
               "mean_decode_batch": med(n, "mean_decode_batch"), "max_decode_batch": max(r["max_decode_batch"] for r in rs),
               "preemptions": med(n, "preemptions")} for n, rs in by.items()]
    return {
        "lamina_kv_capacity_ratio": ratio(by, "lamina", "plain_capped"),
        "lamina_kv_capacity_ratio_end_to_end": ratio(by, "lamina", "plain_capped", "end_to_end_output_tokens_per_s"),
        "lamina_kv_capacity_ratio_equal_memory": ratio(by, "lamina", "plain_equal_memory"),
        "lamina_kv_capacity_ratio_equal_memory_end_to_end": ratio(by, "lamina", "plain_equal_memory",
                                                                  "end_to_end_output_tokens_per_s"),
        "capacity_points": points, "capacity_runs": by, "capacity_workload": plan["workload"],
        "capacity_model": CAPACITY_MODEL, "capacity_rounds": plan["rounds"],
        "capacity_plain_placement": {"cpus": sorted(plain_placement[0]), "threads": plain_placement[1]},
        "capacity_definition": "decode_tokens_per_s: output tokens of decode-only steps over their time; end to "
                               "end: all output tokens over the run's wall time (prefills and recomputed "
                               "preemptions included); plain_capped: plain vLLM on both cores with "
                               f"{x / 2**20:.0f} MiB of KV (about 3 requests); lamina: model worker (no KV) on core "
                               f"0 + one attention server on core 1 with {k}x that, 2 nano-batches in flight "
                               f"(num_nano_batches auto); plain_equal_memory: plain with {k + 1}x; ratios = median over "
                               "interleaved rounds; preemptions: vLLM's vllm:num_preemptions",
    }


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="<= 10 min, every key")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma separated subset of {SECTIONS}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, to check the harness (figures meaningless)")
    args = ap.parse_args()
    if args.smoke:
        _shrink()
    sections = [s for s in args.sections.split(",") if s]
    from lamina_rtt import TOKEN

    os.environ["VLLM_DISAGG_AUTH_TOKEN"] = TOKEN  # the engines' clients must present the servers' token
    from vllm_disagg.testing import apply_test_env

    apply_test_env(in_process=True)
    stem = "attn_bench_smoke" if args.smoke else "attn_bench_quick" if args.quick else "attn_bench"
    path = RESULTS / f"{stem}.json"
    out = json.loads(path.read_text()) if path.exists() and set(sections) != set(SECTIONS) else {}
    out.update(cpu_count=os.cpu_count(), goals=GOALS)
    for name in sections:
        t0, before = time.perf_counter(), load_avg()
        if name == "rtt":
            res = section_rtt(args.quick)
        elif name == "cores":
            res = section_cores(args.quick)
        else:
            binding = out.get("faster_plain_binding", "plain_bind_0_1")
            res = section_capacity(args.quick, ({0}, 1) if binding == "plain_default" else ({0, 1}, 2))
        res.update({f"{name}_load_avg_before": before, f"{name}_load_avg_after": load_avg(),
                    f"{name}_seconds": round(time.perf_counter() - t0, 1)})
        out.update(res)
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
    _plot(out, RESULTS / f"{stem}.png")
    keys = [k for k in out if k.startswith(("lamina_", "send_q_early_", "rtt_us_")) and not isinstance(out[k], dict)]
    print(json.dumps({k: out[k] for k in keys}))
    return 0


def _shrink() -> None:
    """--smoke: every code path on tiny sizes (a few minutes), results under results/attn_bench_smoke.*"""
    global DECODE_BATCH, DECODE_CONTEXT, SMOKE
    DECODE_BATCH, DECODE_CONTEXT, SMOKE = 4, 256, True


SMOKE = False


def _plot(full: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5))
    for kind, color in (("plain", "#777"), ("lamina", "#2a7")):
        pts = sorted((p["kv_gib"] * 1024, p["decode_tokens_per_s"], p["mean_decode_batch"], p["preemptions"])
                     for p in full.get("capacity_points", []) if p["kind"] == kind)
        if pts:
            a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                   label=f"{kind} (KV on {'the attention server' if kind == 'lamina' else 'the engine'})")
            for x, y, batch, pre in pts:
                a.annotate(f"B={batch:g}, {pre:g} preempt.", (x, y), fontsize=7, textcoords="offset points",
                           xytext=(4, 4))
    a.set_xlabel("KV space (MiB)")
    a.set_ylabel("decode tokens/s")
    a.set_title("capacity: long-context decode on 2 cores")
    a.legend(fontsize=8)
    parts = ["vllm_outside_forward", "dense", "attention", "wire", "waits", "fill_drain"]
    colors = ["#bbb", "#48c", "#c84", "#a6c", "#e55", "#fc5"]
    breakdown = full.get("lamina_step_breakdown_ms", {})
    names = list(breakdown)
    bottom = [0.0] * len(names)
    for part, color in zip(parts, colors):
        vals = [breakdown[n].get(part, 0.0) for n in names]
        b.bar(range(len(names)), vals, bottom=bottom, color=color, label=part)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=7)
    b.set_ylabel("ms per decode step")
    b.set_title(f"where a step goes: batch {DECODE_BATCH}, context {DECODE_CONTEXT}, 2 cores")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
