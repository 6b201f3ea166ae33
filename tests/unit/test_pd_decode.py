# SPDX-License-Identifier: Apache-2.0
"""The planner calibration's decode points: only gaps while every request decodes count, and a point
whose first tokens came further apart than its decode lasted (P prefilling the prompts one after
another behind the router) asks for enough tokens to overlap. The join cost reads the one step a new
request joined in."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from pd_decode import join_extra_ms, steady_gaps, tokens_to_overlap  # noqa: E402


def _times(num: int, spread_s: float, tokens: int, gap_s: float = 0.1) -> list[list[float]]:
    return [[i * spread_s + gap_s * k for k in range(tokens)] for i in range(num)]


def test_only_gaps_between_the_last_first_token_and_the_first_last_token_count():
    gaps, ctx = steady_gaps(_times(2, 0.5, 20), context=512)
    assert len(gaps) == 2 * 14 and ctx[0] == 512 + 6  # request 0 joins at its 6th token (0.5 s / 0.1 s)
    assert all(abs(g - 0.1) < 1e-9 for g in gaps)


def test_first_tokens_further_apart_than_the_decode_ask_for_enough_tokens_to_overlap():
    spread_out = _times(4, 3.0, 24)
    assert steady_gaps(spread_out, 512)[0] == []
    longer = tokens_to_overlap(spread_out, 24, batch=4)
    assert longer >= 24 + 90 + 12
    assert len(steady_gaps(_times(4, 3.0, longer), 512)[0]) >= 4 * 3


def test_a_point_that_overlapped_needs_no_more_tokens_than_it_had_plus_the_window():
    assert tokens_to_overlap(_times(4, 0.0, 24), 24, batch=4) == 24 + 12


def test_calibration_prompts_leave_room_for_their_output_under_max_model_len():
    """A `--max-model-len 1024` run sent 1024-token decode prompts (HTTP 400, max_tokens 0) before."""
    from serve_predict import CALIBRATION, capped_plan

    plan = capped_plan(CALIBRATION, 1024)
    assert max(plan["prefill_sizes"]) == 896 and max(plan["decode_contexts"]) == 768
    assert capped_plan(CALIBRATION, 2048)["decode_contexts"] == CALIBRATION["decode_contexts"]


def _with_join_step(num: int, tokens: int, join_at: int, extra_s: float) -> list[list[float]]:
    """`num` requests decoding in lockstep at 0.1 s a step; step `join_at` takes `extra_s` longer."""
    return [[0.01 * i + 0.1 * k + (extra_s if k >= join_at else 0.0) for k in range(tokens)] for i in range(num)]


def test_the_join_cost_is_the_step_ending_at_the_new_requests_first_token_over_the_steady_steps():
    times = _with_join_step(4, 40, join_at=25, extra_s=0.012)
    t_first = 2.5 + 0.012 + 0.002  # the new request's first token comes out of step 25, a little after
    assert abs(join_extra_ms(times, t_send=2.0, t_first=t_first) - 12.0) < 1e-6
    assert join_extra_ms(times, t_send=0.1, t_first=t_first) is None  # no steady window before the send
    assert join_extra_ms(times, t_send=2.0, t_first=9.0) is None  # the batch ended before it joined
