# SPDX-License-Identifier: Apache-2.0
"""Measured-profile schema: piece-wise linear curves and calibration of the models."""

import json

import pytest
from planner_fixtures import TINY, machine

from vllm_disagg.planner.perf_model import build_perf_model
from vllm_disagg.planner.profile import Curve, load_profile, parse_profile


def test_curves_interpolate_and_extrapolate_linearly():
    c = Curve.from_points([{"n": 100, "ms": 10}, {"n": 0, "ms": 0}, {"n": 200, "ms": 30}], "n")
    assert c(50) == pytest.approx(5) and c(150) == pytest.approx(20)
    assert c(300) == pytest.approx(50) and c(-100) == 0.0


def test_repeated_points_are_averaged_and_one_point_scales_proportionally():
    c = Curve.from_points([{"n": 10, "ms": 1}, {"n": 10, "ms": 3}], "n")
    assert c(10) == pytest.approx(2) and c(20) == pytest.approx(4)


def test_a_profile_with_another_schema_is_refused():
    with pytest.raises(ValueError, match="schema"):
        parse_profile({"schema": "something/9"})


def test_a_bad_section_is_named_in_the_error():
    with pytest.raises(ValueError, match="prefill"):
        parse_profile({"prefill": [{"tokens": 1, "ms": 2}]})


def test_decode_context_cost_is_fitted_from_points_that_vary_context(tmp_path):
    data = {"schema": "vllm-disagg-profile/1",
            "prefill": [{"num_tokens": 1, "ms": 1}, {"num_tokens": 100, "ms": 10}],
            "decode": [{"batch_size": b, "context_tokens": c, "ms": 5 + b + 0.001 * b * c}
                       for b in (1, 4, 8) for c in (100, 1000)]}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(data))
    prof = load_profile(path)
    assert prof.decode_context_ms_per_token == pytest.approx(0.001, rel=1e-6)
    perf = build_perf_model(TINY, machine(10_000), prof)
    assert perf.source == "profile"
    assert perf.decode_ms(4, 4 * 1000) == pytest.approx(5 + 4 + 4.0, rel=1e-6)
    assert perf.decode_ms(4, 4 * 100) == pytest.approx(5 + 4 + 0.4, rel=1e-6)


def test_a_quadratic_prefill_profile_charges_attention_per_prompt_in_a_batch():
    # 100 ms + 1 ms/token + 0.001 ms/token^2, sampled exactly at three lengths.
    pts = [{"num_tokens": n, "ms": 100 + n + 0.001 * n * n} for n in (128, 512, 2048)]
    prof = parse_profile({"prefill_fit": "quadratic", "prefill": pts,
                          "decode": [{"batch_size": 1, "ms": 20}, {"batch_size": 8, "ms": 30}]})
    a, b, c, d = prof.prefill_quadratic
    assert (a, b, c) == pytest.approx((100, 1, 0.001), rel=1e-6)
    assert d == 0.0  # single prompts cannot tell per-prompt from per-batch growth
    perf = build_perf_model(TINY, machine(10_000), prof)
    four = perf.prefill_batch_ms([512] * 4)
    assert four == pytest.approx(100 + 2048 + 0.001 * 4 * 512**2)
    assert four < perf.prefill_ms(2048)  # one 2048-token prompt pays 16x the attention of a 512 one
    piecewise = build_perf_model(TINY, machine(10_000), parse_profile(
        {"prefill": pts, "decode": [{"batch_size": 1, "ms": 20}]}))
    assert piecewise.prefill_batch_ms([512] * 4) == pytest.approx(piecewise.prefill_ms(2048))


def _batched_profile(batch_ms) -> dict:
    """Single prompts 100 + n + 0.001 n^2 ms; `batch_ms(k)` for k queued 512-token prompts."""
    pts = [{"num_tokens": n, "ms": 100 + n + 0.001 * n * n} for n in (128, 512, 2048)]
    batched = [{"num_prompts": k, "num_tokens": 512, "ms": batch_ms(k)} for k in (2, 4)]
    return {"prefill_fit": "quadratic", "prefill": pts, "prefill_batched": batched,
            "decode": [{"batch_size": 1, "ms": 20}, {"batch_size": 8, "ms": 30}]}


def test_batched_prefill_points_decide_whether_a_batch_grows_per_prompt_or_with_its_total():
    # A batch that costs what one prompt of its total length costs (growth with the batch's tokens).
    as_total = parse_profile(_batched_profile(lambda k: 100 + 512 * k + 0.001 * (512 * k) ** 2))
    a, b, c, d = as_total.prefill_quadratic
    assert (a, b, c, d) == pytest.approx((100, 1, 0, 0.001), rel=1e-6, abs=1e-9)
    perf = build_perf_model(TINY, machine(10_000), as_total)
    assert perf.prefill_batch_ms([512] * 4) == pytest.approx(perf.prefill_ms(2048), rel=1e-6)
    # A batch that pays attention per prompt only.
    per_prompt = parse_profile(_batched_profile(lambda k: 100 + 512 * k + 0.001 * k * 512**2))
    assert per_prompt.prefill_quadratic == pytest.approx((100, 1, 0.001, 0), rel=1e-6, abs=1e-9)


def test_a_batched_point_without_its_prompt_count_is_refused():
    data = _batched_profile(lambda k: 1000.0)
    data["prefill_batched"] = [{"num_tokens": 512, "ms": 900.0}]
    with pytest.raises(ValueError, match="prefill_batched"):
        parse_profile(data)


def test_an_unknown_prefill_fit_is_refused():
    with pytest.raises(ValueError, match="prefill_fit"):
        parse_profile({"prefill_fit": "cubic", "prefill": [{"num_tokens": 1, "ms": 1}]})


def test_a_prompt_chunk_pays_attention_over_the_tokens_before_it():
    perf = build_perf_model(TINY, machine(10_000), parse_profile(_batched_profile(lambda k: 100 + 512 * k)))
    a, b, c, d = perf.prefill_quadratic
    chunk = perf.prefill_batch_ms([400], [200])
    assert chunk == pytest.approx(a + b * 400 + c * (600**2 - 200**2) + d * 400**2)
    assert perf.prefill_batch_ms([200]) + perf.prefill_batch_ms([400], [200]) > perf.prefill_batch_ms([600])


def test_a_piecewise_profile_puts_each_batched_point_on_the_curve_at_its_total_tokens():
    # Splitwise's form, and what the CPU measured: 4 x 512 queued prompts cost about one 2048-token
    # prompt, so the batch is a point of the batch-token curve (averaged with a single at 2048).
    data = {"prefill": [{"num_tokens": 512, "ms": 750.0}, {"num_tokens": 2048, "ms": 4500.0}],
            "prefill_batched": [{"num_prompts": 2, "num_tokens": 512, "ms": 1450.0},
                                {"num_prompts": 4, "num_tokens": 512, "ms": 5100.0}],
            "decode": [{"batch_size": 1, "ms": 20.0}]}
    curve = parse_profile(data).curve("prefill")
    assert curve(512) == pytest.approx(750.0)
    assert curve(1024) == pytest.approx(1450.0)
    assert curve(2048) == pytest.approx(4800.0)
    assert parse_profile({**data, "prefill_fit": "quadratic"}).curve("prefill")(1024) != pytest.approx(1450.0)
