# SPDX-License-Identifier: Apache-2.0
"""Serving metrics of one replayed trace, measured or simulated: the numbers users feel.

TTFT percentiles; TBT over every inter-token gap of every request (not a request's mean gap, which
hides a one-second stall among fifty fast tokens) and each request's worst gap; output tokens/s; and
goodput under an SLO: the share of requests whose TTFT and *every* gap are within it (a failed
request is never good). `vllm bench serve --save-detailed` gives the inputs (`ttfts`, `itls`,
`errors`), the simulator gives them from its token times, so both go through this one definition.
`bisect_max_rate` finds the highest rate whose goodput stays above a target, given a probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ServedRequest:
    """One request as the client saw it."""

    ttft_s: float | None
    """None when the request failed."""
    gaps_s: tuple[float, ...] = ()
    """Every inter-token gap after the first token."""

    @property
    def ok(self) -> bool:
        return self.ttft_s is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.gaps_s) + 1 if self.ok else 0

    @property
    def worst_gap_s(self) -> float:
        return max(self.gaps_s, default=0.0)


@dataclass(frozen=True)
class Slo:
    """TTFT limit and the limit on every inter-token gap, seconds."""

    ttft_s: float
    gap_s: float

    @property
    def key(self) -> str:
        return f"ttft{_num(self.ttft_s)}s_gap{_num(1e3 * self.gap_s)}ms"

    def met(self, req: ServedRequest) -> bool:
        return req.ok and req.ttft_s <= self.ttft_s and req.worst_gap_s <= self.gap_s


def _num(x: float) -> str:
    return f"{x:g}"


HEADLINE_SLO = Slo(5.0, 0.2)
"""Issue 14's SLO: TTFT <= 5 s and every gap <= 200 ms."""
SLO_GRID = tuple(Slo(t, g) for t in (2.0, 5.0, 10.0) for g in (0.1, 0.2, 0.5, 1.0))


def from_bench_detailed(result: dict) -> list[ServedRequest]:
    """`vllm bench serve --save-detailed` JSON -> requests (an error, or no TTFT, is a failure)."""
    ttfts, itls = result.get("ttfts"), result.get("itls")
    if ttfts is None or itls is None:
        raise ValueError("bench result has no per-request ttfts/itls: run with --save-result --save-detailed")
    errors = result.get("errors") or [""] * len(ttfts)
    out = []
    for ttft, gaps, err in zip(ttfts, itls, errors, strict=True):
        failed = bool(err) or ttft is None or ttft <= 0
        out.append(ServedRequest(None if failed else float(ttft), () if failed else tuple(map(float, gaps))))
    return out


def from_token_times(arrival_s: float, token_times_s: list[float]) -> ServedRequest:
    """A request from its arrival and the times its tokens came out (the simulator's record)."""
    if not token_times_s:
        return ServedRequest(None)
    gaps = tuple(b - a for a, b in zip(token_times_s, token_times_s[1:]))
    return ServedRequest(token_times_s[0] - arrival_s, gaps)


def percentile(values, q: float) -> float | None:
    """numpy's linear-interpolated percentile, None for no values."""
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else None


def goodput(reqs: list[ServedRequest], slo: Slo) -> float | None:
    """Share of requests that met the SLO (failed ones count as missed)."""
    return sum(slo.met(r) for r in reqs) / len(reqs) if reqs else None


def summarize(reqs: list[ServedRequest], duration_s: float | None, slos=SLO_GRID) -> dict:
    """Every metric of one run; seconds as in the inputs, `*_ms` keys in milliseconds."""
    done = [r for r in reqs if r.ok]
    ttft = [r.ttft_s for r in done]
    gaps = [g for r in done for g in r.gaps_s]
    worst = [r.worst_gap_s for r in done if r.gaps_s]
    tokens = sum(r.num_output_tokens for r in done)
    out = {"num_requests": len(reqs), "num_failed": len(reqs) - len(done), "num_gaps": len(gaps),
           "output_tokens": tokens,
           "output_tok_s": tokens / duration_s if duration_s else None}
    out["ttft_mean_ms"] = _ms(float(np.mean(ttft))) if ttft else None
    out |= {f"ttft_p{q}_ms": _ms(percentile(ttft, q)) for q in (50, 90, 99)}
    out |= {f"tbt_p{_q(q)}_ms": _ms(percentile(gaps, q)) for q in (50, 99, 99.9)}
    out |= {f"worst_gap_p{q}_ms": _ms(percentile(worst, q)) for q in (50, 99)}
    out["goodput"] = {s.key: goodput(reqs, s) for s in slos}
    return out


def _q(q: float) -> str:
    return f"{q:g}".replace(".", "")


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def bisect_max_rate(probe: Callable[[float], float | None], lo: float, hi: float, target: float = 0.9,
                    steps: int = 4, known: dict[float, float] | None = None) -> dict:
    """Highest rate whose goodput (from `probe(rate)`) is >= `target`, bisected in log space.

    `known` holds goodputs already measured (the sweep); they narrow the bracket first. Returns the
    bracket: `max_rate` (the highest rate that met the target, None if none did, then `below` says
    the lowest rate tried failed), `min_failing_rate`, and every probe in order."""
    seen = dict(known or {})
    probes = []

    def measure(rate: float) -> float:
        if rate not in seen:
            seen[rate] = probe(rate)
            probes.append({"rate": rate, "goodput": seen[rate]})
        return seen[rate] if seen[rate] is not None else 0.0

    good = max((r for r, g in seen.items() if g is not None and g >= target and r <= hi), default=None)
    bad = min((r for r, g in seen.items() if (g is None or g < target) and r >= lo), default=None)
    if good is None and measure(lo) >= target:
        good = lo
    if good is None:
        return {"max_rate": None, "below": lo, "min_failing_rate": lo, "probes": probes}
    if bad is None or bad <= good:
        bad = None if measure(hi) >= target else hi
        if bad is None:
            return {"max_rate": hi, "min_failing_rate": None, "above": hi, "probes": probes}
    for _ in range(steps):
        mid = math.sqrt(good * bad)
        if measure(mid) >= target:
            good = mid
        else:
            bad = mid
    return {"max_rate": good, "min_failing_rate": bad, "probes": probes}
