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


def _windows(kinds: str, width: float = 2.0) -> list[tuple[str, float, float]]:
    return [("busy" if k == "b" else "idle", i * width, (i + 1) * width) for i, k in enumerate(kinds)]


def _steps(windows, step_s: dict[str, float], num: int = 4, every_tenth_busy: float | None = None) -> list[list[float]]:
    """`num` requests in lockstep; a step takes `step_s[kind]` of the window it starts in (every tenth
    busy step `every_tenth_busy` instead, when given)."""
    t, ts = 0.0, []
    while t < windows[-1][2]:
        ts.append(t)
        kind = next(kind for kind, t0, t1 in windows if t0 <= t < t1)
        slow = kind == "busy" and every_tenth_busy is not None and len(ts) % 10 == 0
        t += every_tenth_busy if slow else step_s[kind]
    return [[x + 0.001 * i for x in ts] for i in range(num)]


def test_decode_beside_a_prefill_is_each_busy_window_over_its_idle_neighbours():
    from pd_decode import interference_ratio

    windows = _windows("ibibi")
    times = _steps(windows, {"idle": 0.05, "busy": 0.055})
    out = interference_ratio(times, windows, joins=[])
    assert abs(out["ratio"] - 1.1) < 0.02 and len(out["ratios"]) == 2


def test_the_spread_beside_a_prefill_is_every_busy_gap_over_its_idle_neighbours_median():
    """The ratio is the busy windows' median; their tail (here one step in ten at 2x) is kept apart as
    the section's `step_jitter`, which the simulator draws from beside a host-mate's prompt step."""
    from pd_decode import JITTER_QUANTILES, interference_ratio

    windows = _windows("ibibi")
    out = interference_ratio(_steps(windows, {"idle": 0.05, "busy": 0.05}, every_tenth_busy=0.1), windows, [])
    jitter = dict(zip(JITTER_QUANTILES, out["step_jitter"]["ratios"]))
    assert out["ratio"] == 1.0 and jitter[0.5] == 1.0 and jitter[0.95] == jitter[1.0] == 2.0
    assert out["step_jitter"]["num_gaps"] == sum(out["num_gaps"][k] for k in (1, 3))
    few = _windows("ibi", width=1.0)  # ~16 busy steps of 2 requests: a ratio, but no spread from ~30 gaps
    out = interference_ratio(_steps(few, {"idle": 0.05, "busy": 0.05}, num=2), few, [])
    assert out["ratio"] == 1.0 and "step_jitter" not in out


def test_a_join_step_inside_a_busy_window_does_not_count_and_empty_windows_give_none():
    from pd_decode import interference_ratio

    windows = _windows("ibi")
    times = _steps(windows, {"idle": 0.05, "busy": 0.05})
    step = next(k for k, t in enumerate(times[0]) if t > 3.0)  # one long join step in the busy window
    times = [[t + (0.5 if k > step else 0.0) for k, t in enumerate(ts)] for ts in times]
    first_token = times[0][step + 1] + 0.002
    joined, counted = interference_ratio(times, windows, [first_token]), interference_ratio(times, windows, [])
    assert joined["ratio"] == counted["ratio"] == 1.0  # a median shrugs off one long gap ...
    assert counted["num_gaps"][1] - joined["num_gaps"][1] == 4  # ... and that step's 4 gaps are not counted
    assert joined["num_gaps"][0] == counted["num_gaps"][0]  # nor is any gap of an idle window
    assert interference_ratio([[0.0, 0.05]], windows, joins=[]) is None


def test_the_step_jitter_pools_every_rounds_gaps_so_a_stall_weighs_by_its_share_of_all_of_them():
    from pd_decode import step_jitter

    steady = [1.0 + 0.0001 * (k % 1000) for k in range(1000)]  # ratios 1.0000 ... 1.0999
    stalled = steady[:985] + [4.0] * 15  # one round: 15 gaps at 4x its median
    rows = [{"batch_size": 4, "gap_ratios": [steady, stalled, steady]}]
    jitter = step_jitter(rows)
    assert "gap_ratios" not in rows[0] and jitter["num_gaps"] == 3000
    assert jitter["ratios"][jitter["quantiles"].index(0.99)] < 1.1  # 0.5 % of all gaps: past the P99
    assert jitter["ratios"][-1] == 4.0  # still in the tail, at its share
    assert step_jitter([{"gap_ratios": [stalled]}])["ratios"][jitter["quantiles"].index(0.99)] == 4.0  # one round alone
    assert step_jitter([{"gap_ratios": [steady[:10]] * 3}]) == {}  # under 50 gaps in all
