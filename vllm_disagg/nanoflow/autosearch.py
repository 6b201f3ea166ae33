# SPDX-License-Identifier: Apache-2.0
"""Automatic parameter search, as in NanoFlow §5.5 (the seed's greedy critical-path search).

For each candidate (dense batch size from the profiled fast sizes, nano-batch counts per op group):
1. build the op graph (`graph.build_graph`) and list-schedule it with profiled op costs;
2. find the critical path; give one more execution unit to the unit class that contributes most to
   it (from the free pool, else from the class contributing least), keep the move if the step gets
   shorter, and repeat until no move helps, with the total capped at the device budget;
3. keep the candidate with the highest tokens/s. A one-unit "inline" candidate (everything on the
   whole device, nothing overlaps) always competes, so the plan never loses to no overlap in the
   model's own estimate. More: README.md, "autosearch.py".
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from vllm_disagg.nanoflow.graph import (
    ATTN,
    DENSE,
    NET,
    OpNode,
    PipelineSpec,
    Schedule,
    build_graph,
    critical_path,
    list_schedule,
)

# cost(op name, tokens in that op's nano-batch, unit share) -> seconds
CostFn = Callable[[str, int, int], float]
SEARCH_LAYERS = 4


@dataclass
class Candidate:
    dense_batch: int
    num_attn_batches: int
    num_dense_batches: int
    shares: dict[str, int]
    inline: bool
    step_s: float
    critical: list = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.dense_batch / self.step_s if self.step_s > 0 else 0.0


def tokens_of(node: OpNode, spec: PipelineSpec, dense_batch: int) -> int:
    n = spec.num_attn_batches if node.name in ("kqv", "attn") else spec.num_dense_batches
    return max(1, dense_batch // n)


def evaluate(
    spec: PipelineSpec,
    dense_batch: int,
    shares: dict[str, int],
    cost: CostFn,
    nodes=None,
    serial: Collection[str] = (),
) -> Schedule:
    """Simulated step of `spec` with the given unit shares (`serial`: units that cannot overlap
    each other, e.g. CPU dense and attention, see graph.list_schedule)."""
    nodes = nodes if nodes is not None else build_graph(spec)
    return list_schedule(
        nodes, lambda n: cost(n.name, tokens_of(n, spec, dense_batch), shares.get(n.unit, 0)), serial
    )


def greedy_shares(
    spec: PipelineSpec,
    dense_batch: int,
    cost: CostFn,
    budget: int,
    budgeted: Sequence[str],
    fixed: dict[str, int] | None = None,
    serial: Collection[str] = (),
) -> tuple[dict[str, int], Schedule]:
    """Critical-path greedy allocation of `budget` units over the `budgeted` unit classes."""
    nodes = build_graph(spec)
    shares = {u: 1 for u in budgeted} | dict(fixed or {})
    best = evaluate(spec, dense_batch, shares, cost, nodes, serial)
    while True:
        move = _best_move(spec, dense_batch, cost, budget, budgeted, shares, best, nodes, serial)
        if move is None:
            return shares, best
        shares, best = move


def _best_move(spec, dense_batch, cost, budget, budgeted, shares, sched, nodes, serial=()):
    contrib = _critical_contribution(sched, nodes)
    ranked = sorted(budgeted, key=lambda u: -contrib.get(u, 0.0))
    free = budget - sum(shares[u] for u in budgeted)
    for gain in ranked:
        if contrib.get(gain, 0.0) <= 0:
            break
        donors = [None] if free > 0 else [u for u in reversed(ranked) if u != gain and shares[u] > 1]
        for donor in donors:
            trial = dict(shares)
            trial[gain] += 1
            if donor is not None:
                trial[donor] -= 1
            cand = evaluate(spec, dense_batch, trial, cost, nodes, serial)
            if cand.makespan < sched.makespan - 1e-12:
                return trial, cand
    return None


def _critical_contribution(sched: Schedule, nodes: Iterable[OpNode]) -> dict[str, float]:
    unit_of = {n.key: n.unit for n in nodes}
    out: dict[str, float] = {}
    for key in critical_path(sched):
        out[unit_of[key]] = out.get(unit_of[key], 0.0) + sched.finish[key] - sched.start[key]
    return out


def fast_sizes(dense_time: dict[int, float]) -> list[int]:
    """Sizes whose tokens/s beats every smaller size (CUTLASS-style cliffs are skipped)."""
    out, best = [], 0.0
    for size in sorted(dense_time):
        rate = size / dense_time[size]
        if rate > best:
            out.append(size)
            best = rate
    return out


def nano_combos(max_n: int = 8, min_n: int = 1) -> list[tuple[int, int]]:
    """(attention, dense) nano-batch counts; `min_n` bounds the attention count from below."""
    counts = [n for n in (1, 2, 4, 8, 16) if n <= max_n]
    return [(a, d) for a in counts for d in counts if a % d == 0 and a >= min_n]


@dataclass
class SearchResult:
    best: Candidate
    candidates: list[Candidate]
    seconds: float


def search(
    cost: CostFn,
    num_layers: int,
    dense_batches: Sequence[int],
    budget: int,
    combos: Sequence[tuple[int, int]] | None = None,
    tensor_parallel: bool = False,
    attention_remote: bool = False,
    progress: Callable[[int], None] | None = None,
    serial: Collection[str] = (),
) -> SearchResult:
    """Greedy unit allocation for every (dense batch, nano-batch counts) candidate; best wins.
    `serial`: unit classes that cannot overlap each other on this device (CPU: dense and attn)."""
    t0 = time.perf_counter()
    layers = min(num_layers, SEARCH_LAYERS)
    scale = num_layers / layers
    cands = []
    for dense_batch, (num_attn_batches, num_dense_batches) in itertools.product(dense_batches, combos or nano_combos()):
        if num_attn_batches > dense_batch:
            continue
        for inline in (True, False):
            cand = _candidate(
                cost,
                layers,
                dense_batch,
                num_attn_batches,
                num_dense_batches,
                budget,
                tensor_parallel,
                attention_remote,
                inline,
                serial,
            )
            cand.step_s *= scale
            cands.append(cand)
        if progress:
            progress(1)
    if not cands:
        raise ValueError(
            f"no candidate: dense batches {list(dense_batches)} smaller than every nano-batch count"
        )
    best = min(cands, key=lambda c: (-c.tokens_per_s, c.num_attn_batches, c.num_dense_batches, not c.inline))
    return SearchResult(best=best, candidates=cands, seconds=time.perf_counter() - t0)


def _candidate(
    cost, layers, dense_batch, num_attn_batches, num_dense_batches, budget, tp, remote, inline, serial=()
) -> Candidate:
    if inline:
        spec = PipelineSpec(layers, num_attn_batches, num_dense_batches, tp, attn_unit=DENSE, net_unit=DENSE)
        shares = {DENSE: budget}
        sched = evaluate(spec, dense_batch, shares, cost)
    else:
        attn_unit = NET if remote else ATTN
        spec = PipelineSpec(layers, num_attn_batches, num_dense_batches, tp, attn_unit=attn_unit)
        budgeted = [DENSE] if remote else [DENSE, ATTN]
        fixed = {NET: 0} if (tp or remote) else {}
        if len(budgeted) > budget:
            return Candidate(dense_batch, num_attn_batches, num_dense_batches, {}, False, float("inf"))
        shares, sched = greedy_shares(spec, dense_batch, cost, budget, budgeted, fixed, serial)
    return Candidate(dense_batch, num_attn_batches, num_dense_batches, shares, inline, sched.makespan, critical_path(sched))
