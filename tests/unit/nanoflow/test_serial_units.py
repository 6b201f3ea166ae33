# SPDX-License-Identifier: Apache-2.0
"""Units that cannot overlap (CPU dense and attention share vLLM's kernel scratchpad) are modelled
as one resource by the list schedule and the search, so the plan that is searched is the plan
that runs under executor.CPU_KERNEL_LOCK."""

from __future__ import annotations

from vllm_disagg.nanoflow.autosearch import search
from vllm_disagg.nanoflow.graph import ATTN, DENSE, PipelineSpec, build_graph, list_schedule


def test_serial_units_never_overlap_in_the_simulated_schedule():
    nodes = build_graph(PipelineSpec(2, 4, 2, attn_unit=ATTN))
    free = list_schedule(nodes, lambda n: 1.0)
    serial = list_schedule(nodes, lambda n: 1.0, serial=(DENSE, ATTN))
    assert serial.makespan == len(nodes)  # one op at a time over both units
    assert free.makespan < serial.makespan  # unconstrained, attention overlaps dense work
    spans = sorted((serial.start[k], serial.finish[k]) for k in serial.start)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def _cost(op: str, tokens: int, share: int) -> float:
    """Every op scales perfectly with its share: splitting units can only pay by overlapping."""
    return tokens / max(share, 1)


def test_the_search_prefers_one_inline_unit_when_dense_and_attention_cannot_overlap():
    serial = search(_cost, 4, [64], budget=2, combos=[(2, 2)], serial=(DENSE, ATTN))
    assert serial.best.inline
    free = search(_cost, 4, [64], budget=2, combos=[(2, 2)])

    def threaded(result):
        return next(c for c in result.candidates if not c.inline)

    # the split plan is costed as serialised (no overlap), not as the free overlap it cannot get
    assert threaded(serial).step_s > threaded(free).step_s
