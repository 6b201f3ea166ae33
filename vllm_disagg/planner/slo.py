# SPDX-License-Identifier: Apache-2.0
"""Request metrics and Splitwise's nine SLOs (Table II, Table VI).

TTFT, TBT (a request's mean time between tokens) and E2E, each at P50/P90/
P99, as slowdowns against the same request alone on a DGX-A100 (Table VI).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_disagg.planner.machine import SimRequest
from vllm_disagg.planner.perf_model import PerfModel

PERCENTILES = (50, 90, 99)
# Table VI: max slowdown vs an uncontended DGX-A100, per metric and percentile.
SLO_TABLE = {
    "ttft": {50: 2.0, 90: 3.0, 99: 6.0},
    "tbt": {50: 1.25, 90: 1.5, 99: 5.0},
    "e2e": {50: 1.25, 90: 1.5, 99: 5.0},
}


def request_latencies(req: SimRequest) -> tuple[float, float, float] | None:
    """(TTFT, TBT, E2E) in seconds, or None if the request did not finish."""
    if req.done_s is None or req.first_token_s is None:
        return None
    ttft = req.first_token_s - req.trace.arrival_s
    e2e = req.done_s - req.trace.arrival_s
    n = req.trace.num_output_tokens
    tbt = (req.done_s - req.first_token_s) / (n - 1) if n > 1 else 0.0
    return ttft, tbt, e2e


def reference_latencies(req: SimRequest, ref: PerfModel) -> tuple[float, float, float]:
    """The same request alone on the reference machine (no batching)."""
    p, n = req.trace.num_prompt_tokens, req.trace.num_output_tokens
    ttft = ref.prefill_ms(p) / 1e3
    tbt = ref.decode_ms(1, p + n // 2) / 1e3 if n > 1 else 0.0
    return ttft, tbt, ttft + (n - 1) * tbt


@dataclass
class SloReport:
    latency_ms: dict[str, dict[int, float]]
    slowdown: dict[str, dict[int, float]]
    num_requests: int
    num_unfinished: int

    @property
    def violations(self) -> list[str]:
        bad = [f"{m}.p{q}" for m, qs in SLO_TABLE.items() for q, lim in qs.items()
               if self.slowdown[m][q] > lim]
        if self.num_unfinished:
            bad.append(f"{self.num_unfinished} unfinished")
        return bad

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict:
        return {"ok": self.ok, "violations": self.violations, "num_requests": self.num_requests,
                "latency_ms": {m: {f"p{q}": v for q, v in d.items()}
                               for m, d in self.latency_ms.items()},
                "slowdown": {m: {f"p{q}": v for q, v in d.items()}
                             for m, d in self.slowdown.items()}}


def slo_report(requests: list[SimRequest], ref: PerfModel) -> SloReport:
    """Percentiles of latency and of slowdown; unfinished requests fail."""
    lat, slow = {"ttft": [], "tbt": [], "e2e": []}, {"ttft": [], "tbt": [], "e2e": []}
    unfinished = 0
    for req in requests:
        got = request_latencies(req)
        if got is None:
            unfinished += 1
            continue
        base = reference_latencies(req, ref)
        for key, g, b in zip(("ttft", "tbt", "e2e"), got, base):
            if key == "tbt" and req.trace.num_output_tokens <= 1:
                continue
            lat[key].append(g * 1e3)
            slow[key].append(g / b if b > 0 else 1.0)
    return SloReport(_pct(lat), _pct(slow), len(requests), unfinished)


def _pct(values: dict[str, list[float]]) -> dict[str, dict[int, float]]:
    out = {}
    for key, vals in values.items():
        arr = np.asarray(vals) if vals else np.zeros(1)
        out[key] = {q: float(np.percentile(arr, q)) for q in PERCENTILES}
    return out
