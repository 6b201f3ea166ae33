# SPDX-License-Identifier: Apache-2.0
"""Calibration replay: vLLM's first-token rule, recorded arrivals, predicted vs measured."""

import pytest
from planner_fixtures import SIMPLE_PROFILE, TINY, machine

from vllm_disagg.planner.calibrate import measured_trace, validate
from vllm_disagg.planner.profile import parse_profile
from vllm_disagg.planner.splitwise_sim import MachineGroup, SimOptions, simulate
from vllm_disagg.planner.traces import TraceRequest
from vllm_disagg.router.policy import Pool


def _one(first_on_decode: bool, simple_profile, out: int = 5):
    opts = SimOptions(first_token_on_decode=first_on_decode)
    groups = [MachineGroup(machine(100_000), Pool.PREFILL, 1),
              MachineGroup(machine(100_000), Pool.DECODE, 1)]
    res = simulate(TINY, groups, [TraceRequest("r0", 0.0, 600, out)], opts, simple_profile)
    return res.requests[0]


def test_vllm_pd_samples_the_first_token_on_decode_after_the_kv_lands(simple_profile):
    # prefill 10+60 ms, layer-wise KV visible 15 ms, then D's first iteration (20 ms) makes token 1.
    r = _one(True, simple_profile)
    assert r.first_token_s == pytest.approx(0.070 + 0.015 + 0.020)
    assert r.done_s == pytest.approx(0.105 + 4 * 0.020)  # 5 tokens, all from D
    splitwise = _one(False, simple_profile)
    assert splitwise.first_token_s == pytest.approx(0.070)  # P's token is the first (§IV-C)


def test_a_one_token_request_still_gets_its_token_from_decode(simple_profile):
    r = _one(True, simple_profile, out=1)
    assert r.first_token_s == r.done_s == pytest.approx(0.105)


def test_recorded_arrivals_are_replayed_exactly():
    meas = {"rps": 9.0, "prompt_tokens": 64, "output_tokens": 3, "arrivals_s": [0.5, 0.25, 2.0]}
    trace = measured_trace(meas)
    assert [r.arrival_s for r in trace] == [0.5, 0.25, 2.0]
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in trace} == {(64, 3)}


def _profile(measured: dict, **machine) -> dict:
    return {**SIMPLE_PROFILE, "machine": {"kv_capacity_tokens": 100_000, **machine},
            "measured": {"rps": 2.0, "prompt_tokens": 600, "output_tokens": 5,
                         "arrivals_s": [0.0, 1.0, 2.0, 3.0], **measured}}


def test_isolated_requests_are_predicted_exactly_and_errors_are_relative():
    # Arrivals 1 s apart never overlap: TTFT = 70 + 15 + 20 ms, TBT = one 20 ms iteration.
    out = validate(TINY, _profile({"ttft_ms_p50": 52.5, "tbt_ms_p90": 20.0},
                                  kv_layerwise_overhead_ms=2.0, layerwise_min_tokens=512))
    assert out["predicted"]["ttft_ms_p50"] == pytest.approx(105.0)
    assert out["relative_error"]["ttft_ms_p50"] == pytest.approx(1.0)
    assert out["relative_error"]["tbt_ms_p90"] == pytest.approx(0.0, abs=1e-9)
    assert set(out["measured"]) == {"ttft_ms_p50", "tbt_ms_p90"}
    assert out["num_unfinished"] == 0


def test_queueing_on_the_prompt_machine_shows_in_predicted_ttft_percentiles():
    burst = validate(TINY, _profile({"arrivals_s": [0.0] * 4, "ttft_ms_p90": 1.0},
                                    max_num_batched_tokens=600))
    # four 600-token prompts, one per 70 ms prompt iteration (the chunk budget holds one).
    assert burst["predicted"]["ttft_ms_p90"] > 3 * 70


def test_a_profile_without_the_validation_workload_is_refused():
    with pytest.raises(ValueError, match="measured"):
        validate(TINY, {**SIMPLE_PROFILE, "measured": {"rps": 1.0}})


def test_prompts_queued_behind_a_busy_prompt_machine_share_its_next_iteration_at_the_batched_cost():
    # What the CPU validation showed: a burst queues on P while it prefills, and vLLM's scheduler
    # puts every queued prompt (up to max_num_batched_tokens) into P's next step. Here a batch of
    # k prompts costs what one prompt of their total length costs (measured batched points).
    pts = [{"num_tokens": n, "ms": 100 + n + 0.001 * n * n} for n in (128, 512, 2048)]
    batched = [{"num_prompts": k, "num_tokens": 512, "ms": 100 + 512 * k + 0.001 * (512 * k) ** 2}
               for k in (2, 4)]
    prof = parse_profile({"prefill_fit": "quadratic", "prefill": pts, "prefill_batched": batched,
                          "decode": [{"batch_size": 1, "ms": 20}, {"batch_size": 8, "ms": 30}]})
    groups = [MachineGroup(machine(100_000), Pool.PREFILL, 1),
              MachineGroup(machine(100_000), Pool.DECODE, 1)]
    trace = [TraceRequest("r0", 0.0, 512, 2)] + [TraceRequest(f"r{i}", 0.01 * i, 512, 2) for i in (1, 2, 3, 4)]
    res = simulate(TINY, groups, trace, SimOptions(prompt_token_cap=2048), prof)
    one, four = (100 + 512 + 0.001 * 512**2) / 1e3, (100 + 2048 + 0.001 * 2048**2) / 1e3
    first = {r.req_id: r.first_token_s for r in res.requests}
    assert first["r0"] == pytest.approx(one)
    assert [first[f"r{i}"] for i in (1, 2, 3, 4)] == pytest.approx([one + four] * 4)


def test_decode_is_replayed_from_the_measured_first_tokens_to_separate_d_from_p():
    # Requests 1 s apart decode alone (20 ms per token); two landing together decode as a batch of
    # two (21 ms). The replay uses the measured first-token times, not the simulated P.
    meas = {"first_token_s": [5.0, 9.0, 9.0, 20.0], "tbt_ms_p50": 20.0, "tbt_ms_p90": 25.0}
    out = validate(TINY, _profile(meas))["decode_given_first_tokens"]
    assert out["predicted"]["tbt_ms_p50"] == pytest.approx(20.5)
    assert out["predicted"]["tbt_ms_p90"] == pytest.approx(21.0)
    assert out["relative_error"]["tbt_ms_p90"] == pytest.approx(21.0 / 25.0 - 1)


def test_a_first_token_list_that_does_not_match_the_arrivals_is_refused():
    with pytest.raises(ValueError, match="first_token_s"):
        validate(TINY, _profile({"first_token_s": [1.0], "ttft_ms_p50": 1.0}))
