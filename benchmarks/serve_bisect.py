# SPDX-License-Identifier: Apache-2.0
"""serve_bench's rate search (issue 14): the highest rate at which a deployment keeps >= 90 % goodput.

Bisected in log space (planner/goodput.py `bisect_max_rate`), one replay per probe. A deployment that
the rounds measure is searched in its last round's start, right after its headline replays (serve_bench
`Bench.deployment`): one engine start fewer per searched deployment. The plain baseline, known only once
every round has run, and any deployment the rounds left out get a start of their own. A probe replays
the window's first requests, as many as arrive in about `probe_cap_s` at that rate (at least
`probe_min_requests`, at most the window): at full size the search probed down to 0.04 req/s with 30
requests each, 600 s a probe, over an hour per deployment on two cores. The probe's size is recorded
with its run, and the planner predicts that same sub-window. With no headline rounds in the same run
(`--bisect-only`), the headline rate is probed first, so that the bracket starts where the rounds would
have put it.
"""

from __future__ import annotations

import math
import statistics

from serve_deploy import DEPLOYMENTS, started
from serve_run import log, warm_up

from vllm_disagg.planner.goodput import HEADLINE_SLO, bisect_max_rate
from vllm_disagg.planner.traces import TraceRequest


def probe_window(window: list[TraceRequest], rate: float, cap_s: float, min_requests: int) -> list[TraceRequest]:
    """The window's first requests that a probe at `rate` replays (about `cap_s` of arrivals)."""
    num = max(min_requests, math.floor(rate * cap_s))
    return window[:max(1, min(len(window), num))]


def known_goodputs(runs: list[dict], name: str, full_size: int) -> dict[float, float]:
    """Median goodput per rate of `name`'s full-window runs in this run (the rounds narrow the bracket)."""
    seen: dict[float, list[float]] = {}
    for row in runs:
        if row["deployment"] == name and row.get("window_size", full_size) == full_size:
            seen.setdefault(row["rate"], []).append(row["goodput"][HEADLINE_SLO.key])
    return {rate: statistics.median(g) for rate, g in seen.items()}


def search_rates(plan, known: dict[float, float], probe) -> dict:
    """The bracket from `known` full-window goodputs, probing more with `probe(rate)`. With nothing
    known (no rounds in this run), the headline rate is probed first, where the rounds would have."""
    seeded = {} if known else {plan.rate: probe(plan.rate)}
    found = bisect_max_rate(probe, lo=plan.rate / 4, hi=plan.bisect_hi or plan.saturation_rate, steps=plan.bisect_steps,
                            known=known or seeded)
    return found | {"seeded": [{"rate": r, "goodput": g} for r, g in seeded.items()]}


def search(bench, alias: str, name: str, running) -> None:
    """`name`'s rate search on its running deployment, recorded as `bench.max_rates[alias]`."""
    plan = bench.plan

    def probe(rate: float) -> float:
        window = probe_window(bench.trace["requests"], rate, plan.probe_cap_s, plan.probe_min_requests)
        rows = [bench.run_once(running, round(rate, 4), -1, "bisect", window, replay=i)
                for i in range(plan.probe_replays)]
        return statistics.median(row["goodput"][HEADLINE_SLO.key] for row in rows)

    known = known_goodputs(bench.runs, name, len(bench.trace["requests"]))
    bench.max_rates[alias] = search_rates(plan, known, probe) | {"deployment": name}
    log(f"max rate {alias}: {bench.max_rates[alias]}")


def bisect(bench, plain: str, lock) -> dict:
    """Every deployment in `bench.plan.bisect` ('plain' = the baseline binding) not searched in its
    last round yet, each in a start of its own: its max rate bracket."""
    out = bench.max_rates
    for alias in bench.plan.bisect:
        name = plain if alias == "plain" else alias
        if name is None or alias in out or name in out:  # 'plain' whose binding --bisect also named
            continue
        with lock(bench.args.lock), started(DEPLOYMENTS[name], bench.args.model_dir, bench.args.max_model_len,
                                            bench.work / "logs" / f"{name}_bisect") as running:
            warm_up(running, min(600, bench.args.max_model_len // 2))
            bench.calibrate(running)
            search(bench, alias, name, running)
        bench.after_phase()
    return out


def as_plain(max_rates: dict, plain: str | None) -> dict:
    """The searches with the baseline's under 'plain' too: `--bisect plain_bind01` searched the binding
    that the rounds then picked, and the ratio keys read 'plain'. Another binding's search is not the
    baseline's and stays under its own name only."""
    if "plain" in max_rates or plain not in max_rates:
        return max_rates
    return max_rates | {"plain": max_rates[plain]}


def rate_ratio(max_rates: dict, a: str, b: str, bound_ok: bool = False) -> float | None:
    """a's max rate over b's; None unless both searches found one. With `bound_ok`, the lower bound
    when only b found none (`rate_bound`; the result's secondary `*_bound` key says it is one): the
    goal is "at least", so a bound that meets it meets it."""
    ra, rb = (max_rates.get(x, {}).get("max_rate") for x in (a, b))
    if ra and rb:
        return ra / rb
    bound = rate_bound(max_rates, a, b) if bound_ok else None
    return bound["at_least"] if bound else None


def rate_bound(max_rates: dict, a: str, b: str) -> dict | None:
    """What the searches bound when the ratio has no value because b met the goal at no rate tried:
    a's max rate over the lowest rate b failed is a lower bound."""
    fa, fb = max_rates.get(a), max_rates.get(b)
    if not fa or not fb or (fa.get("max_rate") and fb.get("max_rate")):
        return None
    if fa.get("max_rate") and fb.get("max_rate") is None and fb.get("below"):
        return {"at_least": fa["max_rate"] / fb["below"], "why": f"{b} kept < 90 % even at {fb['below']:g} req/s"}
    return None
