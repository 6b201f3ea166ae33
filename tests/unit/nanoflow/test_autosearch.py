# SPDX-License-Identifier: Apache-2.0
"""The §5.5 search on a synthetic op graph with given costs: it must find the known optimum."""

from __future__ import annotations

import itertools
import json

import pytest

from vllm_disagg.nanoflow.autosearch import evaluate, fast_sizes, greedy_shares, search
from vllm_disagg.nanoflow.graph import ATTN, DENSE, PipelineSpec
from vllm_disagg.nanoflow.plan import NanoBatchCounts, NanoFlowPlan, resolve_plan

WORK = {"kqv": 2.0, "attn": 3.0, "o": 1.0, "ugd": 6.0}
LAUNCH = 0.4  # fixed cost per op: more nano-batches are not free


def synthetic_cost(op: str, tokens: int, share: int) -> float:
    """Non-linear speed-up with units (Fig. 7): memory-bound attention saturates at 2 units."""
    speedup = min(share, 2) if op == "attn" else max(share, 1) ** 0.9
    return LAUNCH + WORK[op] * tokens / 16 / speedup


def brute_force(layers, dense_batch, budget, combos):
    best = None
    for num_attn_batches, num_dense_batches in combos:
        inline = PipelineSpec(layers, num_attn_batches, num_dense_batches, attn_unit=DENSE)
        t = evaluate(inline, dense_batch, {DENSE: budget}, synthetic_cost).makespan
        if best is None or t < best[0] - 1e-12:
            best = (t, num_attn_batches, num_dense_batches, {DENSE: budget})
        spec = PipelineSpec(layers, num_attn_batches, num_dense_batches, attn_unit=ATTN)
        for d, a in itertools.product(range(1, budget), repeat=2):
            if d + a > budget:
                continue
            t = evaluate(spec, dense_batch, {DENSE: d, ATTN: a}, synthetic_cost).makespan
            if best is None or t < best[0] - 1e-12:
                best = (t, num_attn_batches, num_dense_batches, {DENSE: d, ATTN: a})
    return best


def _partitioned_optimum(spec, budget):
    return min(
        evaluate(spec, 64, {DENSE: d, ATTN: a}, synthetic_cost).makespan
        for d in range(1, budget)
        for a in range(1, budget - d + 1)
    )


@pytest.mark.parametrize("budget", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("counts", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)])
def test_greedy_critical_path_allocation_finds_the_brute_force_optimum(budget, counts):
    spec = PipelineSpec(3, *counts, attn_unit=ATTN)
    shares, sched = greedy_shares(spec, 64, synthetic_cost, budget, [DENSE, ATTN])
    best = _partitioned_optimum(spec, budget)
    assert sum(shares.values()) <= budget
    assert sched.makespan == pytest.approx(best)


def test_the_search_over_nano_batch_counts_picks_the_known_optimum():
    combos = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4), (8, 8)]
    result = search(synthetic_cost, 3, [64], budget=6, combos=combos)
    t, num_attn_batches, num_dense_batches, shares = brute_force(3, 64, 6, combos)
    best = result.best
    assert not best.inline
    assert best.step_s == pytest.approx(t)
    assert (best.num_attn_batches, best.num_dense_batches) == (num_attn_batches, num_dense_batches)
    assert best.shares == shares
    assert 1 < num_attn_batches < 8  # the launch cost makes the optimum interior: a real trade-off


def test_inline_wins_when_nothing_can_overlap():
    # attention costs nothing and units give no speed-up: partitioning only loses cores
    def cost(op, tokens, share):
        return 0.0 if op == "attn" else WORK[op] * tokens / 16 / min(share, 1)

    result = search(cost, 2, [32], budget=2, combos=[(1, 1), (2, 2)])
    assert result.best.inline


def test_discrete_batching_keeps_only_sizes_faster_than_every_smaller_one():
    # 96 is a "cliff" (slower per token than 64), like CUTLASS at 2049 vs 2048
    times = {16: 1.0, 32: 1.5, 64: 2.0, 96: 3.5, 128: 3.6}
    assert fast_sizes(times) == [16, 32, 64, 128]


def test_a_plan_round_trips_through_json_and_resolves_counts(tmp_path):
    plan = NanoFlowPlan(
        nano_batches=NanoBatchCounts(attn=4, dense=2), units={"dense": 1, "attn": 1}, dense_batch_size=64
    )
    path = plan.save(tmp_path / "p.json")
    assert NanoFlowPlan.load(path) == plan
    assert resolve_plan("auto", str(path), "m").nano_batches == NanoBatchCounts(attn=4, dense=2)
    assert resolve_plan(2, str(path), "m").nano_batches == NanoBatchCounts(attn=2, dense=2)
    assert resolve_plan(4, None, "m").nano_batches == NanoBatchCounts(attn=4, dense=2)


def test_a_plan_with_a_wrong_version_or_bad_counts_fails_with_the_fix(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="vllm-disagg tune"):
        NanoFlowPlan.load(bad)
    with pytest.raises(ValueError, match="multiple"):
        NanoBatchCounts(attn=3, dense=2)
