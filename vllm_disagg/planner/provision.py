# SPDX-License-Identifier: Apache-2.0
"""Splitwise provisioning search (§IV-D, Fig. 12): prompt × token machine counts.

Designs AA / HH / HA / HHcap (and the all-mixed Baseline-A100/H100). The
search simulates the trace on each candidate cluster, drops those that
miss any of the nine SLOs, and optimises cost, power or throughput, with an
optional iso-power or iso-cost budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec, get_hardware
from vllm_disagg.planner.perf_model import build_perf_model
from vllm_disagg.planner.profile import Profile
from vllm_disagg.planner.slo import slo_report
from vllm_disagg.planner.splitwise_sim import MachineGroup, SimOptions, simulate
from vllm_disagg.planner.traces import TraceRequest
from vllm_disagg.router.policy import Pool

# Splitwise §IV-D / Table V: (prompt machine, token machine); None = all mixed.
DESIGNS: dict[str, tuple[str, str | None]] = {
    "AA": ("dgx-a100", "dgx-a100"),
    "HH": ("dgx-h100", "dgx-h100"),
    "HA": ("dgx-h100", "dgx-a100"),
    "HHcap": ("dgx-h100", "dgx-h100-cap"),
    "baseline-a100": ("dgx-a100", None),
    "baseline-h100": ("dgx-h100", None),
}
REFERENCE_MACHINE = "dgx-a100"
"""Table VI SLOs are slowdowns against an uncontended DGX-A100."""


def iso_count(ref: HardwareSpec, num_ref: int, other: HardwareSpec, by: str = "power") -> int:
    """Machines of `other` within the power (or cost) of `num_ref` x `ref`."""
    if by == "power":
        return math.floor(num_ref * ref.power_w / other.power_w + 1e-9)
    return math.floor(num_ref * ref.price_per_hour / other.price_per_hour + 1e-9)


def request_cost_cents(e2e_s: float, machine: HardwareSpec) -> float:
    """Cost of holding one machine for a request's E2E (Splitwise Table IV)."""
    return e2e_s / 3600 * machine.price_per_hour * 100


@dataclass
class Candidate:
    num_prompt: int
    num_token: int
    cost_per_hour: float
    power_w: float
    ok: bool = False
    violations: list[str] = field(default_factory=list)
    rps: float = 0.0
    slo: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class Design:
    """Hardware of one Splitwise design, resolved from the catalog."""

    name: str
    prompt: HardwareSpec
    token: HardwareSpec | None

    @classmethod
    def named(cls, name: str, extra_catalogs: tuple[str, ...] = ()) -> Design:
        key = {k.lower(): k for k in DESIGNS}.get(name.lower())
        if key is None:
            raise KeyError(f"unknown design {name!r}; choose from {', '.join(DESIGNS)}")
        p, t = DESIGNS[key]
        return cls(key, get_hardware(p, extra_catalogs),
                   get_hardware(t, extra_catalogs) if t else None)

    @property
    def is_baseline(self) -> bool:
        return self.token is None

    def groups(self, num_prompt: int, num_token: int) -> list[MachineGroup]:
        if self.is_baseline:
            return [MachineGroup(self.prompt, Pool.MIXED, num_prompt)]
        return [MachineGroup(self.prompt, Pool.PREFILL, num_prompt),
                MachineGroup(self.token, Pool.DECODE, num_token)]

    def cost(self, num_prompt: int, num_token: int) -> float:
        return num_prompt * self.prompt.price_per_hour + (num_token * self.token.price_per_hour
                                                   if self.token else 0.0)

    def power(self, num_prompt: int, num_token: int) -> float:
        return num_prompt * self.prompt.power_w + (num_token * self.token.power_w if self.token else 0.0)


@dataclass
class Evaluator:
    """Simulates one (n_prompt, n_token) cluster on a trace, with memoisation."""

    model: ModelSpec
    design: Design
    options: SimOptions = field(default_factory=SimOptions)
    profile: Profile | None = None
    cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        ref = get_hardware(REFERENCE_MACHINE)
        self.reference = build_perf_model(self.model, ref, self.profile)

    def __call__(self, num_prompt: int, num_token: int, trace: list[TraceRequest], rps: float) -> Candidate:
        key = (num_prompt, num_token, rps)
        if key not in self.cache:
            self.cache[key] = self._run(num_prompt, num_token, trace, rps)
        return self.cache[key]

    def _run(self, num_prompt: int, num_token: int, trace: list[TraceRequest], rps: float) -> Candidate:
        opts = self.options
        if opts.max_sim_s is None and trace:
            opts = replace(opts, max_sim_s=4 * trace[-1].arrival_s + 60)
        result = simulate(self.model, self.design.groups(num_prompt, num_token), trace, opts, self.profile)
        rep = slo_report(result.requests, self.reference)
        return Candidate(num_prompt, num_token, self.design.cost(num_prompt, num_token), self.design.power(num_prompt, num_token),
                         rep.ok, rep.violations, rps, rep.to_dict())


TraceFn = Callable[[float], list[TraceRequest]]


@dataclass
class SearchResult:
    best: Candidate | None
    evaluated: list[Candidate]
    objective: str
    design: str

    def to_dict(self) -> dict:
        return {"design": self.design, "objective": self.objective,
                "best": self.best.to_dict() if self.best else None,
                "evaluated": [c.to_dict() for c in self.evaluated]}


def search_min(evaluate: Evaluator, trace_fn: TraceFn, rps: float, objective: str,
               max_prompt: int, max_token: int, budget: Callable[[Candidate], bool]
               ) -> SearchResult:
    """Iso-throughput search: cheapest (or lowest-power) cluster meeting all
    SLOs at `rps`. Walks the feasibility staircase: min #token machines is
    non-increasing in #prompt machines, so ~max_prompt+max_token runs."""
    trace = trace_fn(rps)
    design = evaluate.design
    key = (lambda c: c.cost_per_hour) if objective == "cost" else (lambda c: c.power_w)
    if design.is_baseline:
        frontier = _baseline_min(evaluate, trace, rps, max_prompt)
    else:
        frontier = _frontier(evaluate, trace, rps, max_prompt, max_token, key)
    ok = [c for c in frontier if budget(c)]
    best = min(ok, key=lambda c: (key(c), c.num_prompt + c.num_token), default=None)
    return SearchResult(best, list(evaluate.cache.values()), objective, design.name)


def _frontier(evaluate: Evaluator, trace, rps: float, max_p: int, max_t: int,
              key) -> list[Candidate]:
    """For each #token machines (ascending), the fewest prompt machines that
    meet the SLOs (bisection: that number is non-increasing in #token);
    stop once even one prompt machine would cost more than the best found."""
    frontier: list[Candidate] = []
    hi_p = max_p
    for num_token in range(1, max_t + 1):
        if frontier and key(_bare(evaluate, 1, num_token)) >= min(key(c) for c in frontier):
            break
        if not evaluate(hi_p, num_token, trace, rps).ok:
            continue
        lo, hi = 1, hi_p
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if evaluate(mid, num_token, trace, rps).ok else (mid + 1, hi)
        frontier.append(evaluate(lo, num_token, trace, rps))
        hi_p = lo
    return frontier


def _bare(evaluate: Evaluator, num_prompt: int, num_token: int) -> Candidate:
    d = evaluate.design
    return Candidate(num_prompt, num_token, d.cost(num_prompt, num_token), d.power(num_prompt, num_token))


def _baseline_min(evaluate: Evaluator, trace, rps: float, max_n: int) -> list[Candidate]:
    lo, hi, found = 1, max_n, None
    while lo <= hi:
        mid = (lo + hi) // 2
        c = evaluate(mid, 0, trace, rps)
        if c.ok:
            found, hi = c, mid - 1
        else:
            lo = mid + 1
    return [found] if found else []


def max_rps(evaluate: Evaluator, trace_fn: TraceFn, num_prompt: int, num_token: int,
            lo: float, hi: float, iters: int = 6) -> Candidate | None:
    """Highest request rate meeting all SLOs on a fixed cluster (bisection)."""
    best = None
    for _ in range(iters):
        mid = (lo + hi) / 2
        c = evaluate(num_prompt, num_token, trace_fn(mid), round(mid, 3))
        if c.ok:
            best, lo = c, mid
        else:
            hi = mid
    return best


def search_throughput(evaluate: Evaluator, trace_fn: TraceFn, budget_kind: str,
                      budget_value: float, rps_range: tuple[float, float],
                      step: int = 1) -> SearchResult:
    """Iso-power / iso-cost throughput-optimised design (Fig. 18): for each
    split of the budget, the max RPS meeting SLOs; keep the best split."""
    design = evaluate.design
    unit = (lambda h: h.power_w) if budget_kind == "power" else (lambda h: h.price_per_hour)
    rows = []
    if design.is_baseline:
        splits = [(math.floor(budget_value / unit(design.prompt) + 1e-9), 0)]
    else:
        splits = []
        for num_prompt in range(1, int(budget_value / unit(design.prompt)) + 1, step):
            num_token = math.floor((budget_value - num_prompt * unit(design.prompt)) / unit(design.token) + 1e-9)
            if num_token >= 1:
                splits.append((num_prompt, num_token))
    for num_prompt, num_token in splits:
        c = max_rps(evaluate, trace_fn, num_prompt, num_token, *rps_range)
        if c is not None:
            rows.append(c)
    best = max(rows, key=lambda c: c.rps, default=None)
    return SearchResult(best, rows, "throughput", design.name)
