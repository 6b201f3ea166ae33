# SPDX-License-Identifier: Apache-2.0
"""serve_bench.py's figures from its runs: per-deployment medians over rounds, paired ratios (a round's
pairs saw the same box), the plain baseline (the faster binding), and the issue's goal keys."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

from serve_bisect import as_plain, rate_bound, rate_ratio

from vllm_disagg.planner.goodput import HEADLINE_SLO

TRANSPORT_KEYS = ("push_vs_raw_tcp_same_streams", "shm_vs_memcpy")  # transport_bench.py's


def cell(runs: list[dict], dep: str, kind: str) -> list[dict]:
    return sorted((r for r in runs if r["deployment"] == dep and r["kind"] == kind), key=lambda r: r["round"])


def metric(row: dict, key: str) -> float | None:
    return row["goodput"][HEADLINE_SLO.key] if key == "goodput" else row.get(key)


def median_of(rows: list[dict], key: str) -> float | None:
    vals = [v for v in (metric(r, key) for r in rows) if v is not None]
    return statistics.median(vals) if vals else None


def paired_ratio(runs: list[dict], a: str, b: str, key: str, kind: str = "headline") -> dict | None:
    """Median over rounds of a's metric / b's in the same round (pairs from one round saw the same box).
    A round where b scored 0 and a did not is an unbounded ratio, not a missing one: dropping it (as
    before) hid that vLLM's NIXL P/D kept no request within the SLO; 0/0 rounds say nothing."""
    ra, rb = {r["round"]: r for r in cell(runs, a, kind)}, {r["round"]: r for r in cell(runs, b, kind)}
    pairs = [(metric(ra[i], key), metric(rb[i], key)) for i in sorted(ra.keys() & rb.keys())]
    ratios = [x / y if y else math.inf for x, y in pairs if x is not None and y is not None and (x or y)]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "rounds": ratios}


def medians(runs: list[dict]) -> dict:
    keys = ("goodput", "goodput_tpot", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p99_ms",
            "tbt_p999_ms", "worst_gap_p50_ms", "worst_gap_p99_ms", "output_tok_s", "num_failed")
    out: dict = {}
    for dep in {r["deployment"] for r in runs}:
        for kind in ("headline", "saturation"):
            rows = cell(runs, dep, kind)
            if rows:
                slo_keys = rows[0]["goodput"]
                out.setdefault(dep, {})[kind] = {k: median_of(rows, k) for k in keys} | {
                    "goodput_grid": {s: statistics.median(r["goodput"][s] for r in rows) for s in slo_keys},
                    "breakdown": {k: median_of([r["breakdown"] for r in rows], k) for k in rows[0]["breakdown"]},
                    "rate": rows[0]["rate"], "num_rounds": len(rows)}
    return out


def pick_plain(med: dict) -> str | None:
    """The baseline: the plain binding with the higher goodput at the headline rate (TTFT P50 breaks ties)."""
    cands = [d for d in ("plain_default", "plain_bind01") if "headline" in med.get(d, {})]
    if not cands:
        return None
    return max(cands, key=lambda d: (med[d]["headline"]["goodput"] or 0, -(med[d]["headline"]["ttft_p50_ms"] or 0)))


def summary(bench, plain: str | None, max_rates: dict, prediction: dict | None, quick: bool) -> dict:
    runs, med = bench.runs, medians(bench.runs)
    ours, nixl = "ours_tcp", "vllm_nixl"
    max_rates = as_plain(max_rates, plain)

    def ratio(a, b, key, kind="headline"):
        """The paired median; "unbounded" when b scored 0 in most rounds that a did not (JSON has no inf)."""
        got = paired_ratio(runs, a, b, key, kind) if a and b else None
        if got is None:
            return None
        return "unbounded" if math.isinf(got["median"]) else got["median"]

    nixl_rows = [r for r in runs if r["deployment"].startswith("vllm_nixl")]
    kv = [r["kv"] for r in nixl_rows]
    exposed = [r["breakdown"].get("push_exposed_ms") for r in cell(runs, ours, "headline")]
    keys = {
        "goodput_ratio_vs_plain": ratio(ours, plain, "goodput"),
        "max_rate_ratio_vs_plain": rate_ratio(max_rates, "ours_tcp", "plain", bound_ok=True),
        "p99_tbt_ratio_vs_plain": ratio(ours, plain, "tbt_p99_ms"),
        "ttft_p50_ratio_vs_plain": ratio(ours, plain, "ttft_p50_ms"),
        "throughput_ratio_vs_plain": ratio(ours, plain, "output_tok_s", "saturation"),
        "goodput_ratio_vs_vllm_nixl": ratio(ours, nixl, "goodput"),
        "max_rate_ratio_vs_vllm_nixl": rate_ratio(max_rates, "ours_tcp", "vllm_nixl", bound_ok=True),
        "ttft_p50_ratio_vs_vllm_nixl": ratio(ours, nixl, "ttft_p50_ms"),
        "vllm_nixl_kv_bytes": min((k["kv_bytes"] for k in kv), default=None),
        "vllm_nixl_recomputes": sum(k["recomputes"] + k["transfer_failures"] for k in kv) if kv else None,
        "planner_max_error": (prediction or {}).get("max_abs_error_below_saturation"),
        "exposed_transfer_ms": statistics.median([e for e in exposed if e is not None]) if any(
            e is not None for e in exposed) else None,
        **dict.fromkeys(TRANSPORT_KEYS),
        # issue 20: throughput with tracing on (default sampling) over off, paired by round at saturation
        "tracing_overhead_ratio": ratio("ours_traced", ours, "output_tok_s", "saturation"),
    }
    plain_goodput = med.get(plain, {}).get("headline", {}).get("goodput") if plain else None
    secondary = {f"{k}_{a}_vs_{b}": ratio(a, b, m, kind) for a, b in ((o, plain) for o in (
        "ours_shm", "ours_nano", "ours_pd_only", "ours_colocate_only", "ours_mixed", "ours_mixed_both", "vllm_nixl")) for k, m, kind in (("goodput_ratio", "goodput", "headline"),
                                                                  ("ttft_p50_ratio", "ttft_p50_ms", "headline"),
                                                                  ("p99_tbt_ratio", "tbt_p99_ms", "headline"),
                                                                  ("throughput_ratio", "output_tok_s", "saturation"))}
    secondary |= {f"max_rate_ratio_vs_{b}_bound": rate_bound(max_rates, "ours_tcp", b) for b in ("plain", "vllm_nixl")}
    return {**keys, "quick": quick, "plain_baseline": plain, "plain_goodput_at_rate": plain_goodput,
            "rate_in_goal_band": None if plain_goodput is None else 0.3 <= plain_goodput <= 0.7,
            "slo": asdict(HEADLINE_SLO), "rate": bench.plan.rate, "secondary": secondary,
            "nixl_verified": _all_or_none([k["verified"] for k in kv]),
            "ours_verified": _all_or_none([r["kv"]["verified"] for r in runs if r["deployment"].startswith("ours")]),
            "load_first": runs[0]["load_before"] if runs else None, "load_last": runs[-1]["load_after"] if runs else None}


def _all_or_none(flags: list[bool]) -> bool | None:
    return all(flags) if flags else None
