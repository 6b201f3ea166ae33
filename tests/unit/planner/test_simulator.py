# SPDX-License-Identifier: Apache-2.0
"""Simulator routing, batching, KV transfer and preemption on hand-made traces."""

from collections import Counter

import pytest
from planner_fixtures import TINY, machine

from vllm_disagg.planner.splitwise_sim import MachineGroup, SimOptions, kv_capacity_tokens, simulate
from vllm_disagg.planner.traces import TraceRequest
from vllm_disagg.router.policy import Pool, SchedulerConfig


def _req(i, t, p, o):
    return TraceRequest(f"r{i}", t, p, o)


def _pd(kv=100_000, n_p=1, n_d=1):
    hw = machine(kv)
    return [MachineGroup(hw, Pool.PREFILL, n_p), MachineGroup(hw, Pool.DECODE, n_d)]


def _by_id(result):
    return {r.req_id: r for r in result.requests}


def test_machine_memory_is_turned_into_kv_token_capacity():
    assert kv_capacity_tokens(TINY, machine(1234)) == 1234


def test_one_request_follows_prefill_then_layerwise_kv_then_decode(simple_profile):
    res = simulate(TINY, _pd(), [_req(0, 0.0, 600, 5)], profile=simple_profile)
    r = _by_id(res)["r0"]
    # prefill 10+60 ms; KV 30 ms, layer-wise: max(2, 30/2 layers) visible; 4 decodes of 20 ms.
    assert r.first_token_s == pytest.approx(0.070)
    assert r.done_s == pytest.approx(0.070 + 0.015 + 4 * 0.020)
    assert (r.prefill_id[0], r.decode_id[0]) == ("p", "d")


def test_small_prompts_use_serialized_transfer(simple_profile):
    res = simulate(TINY, _pd(), [_req(0, 0.0, 300, 2)], profile=simple_profile)
    r = _by_id(res)["r0"]
    assert r.done_s - r.first_token_s == pytest.approx(0.015 + 0.020)  # 300 x 0.05 ms + 1 decode


def test_prompts_are_batched_fcfs_up_to_2048_tokens(simple_profile):
    # r9 keeps the prompt machine busy for 20 ms while the others queue up.
    trace = [_req(9, 0.0, 100, 1)] + [_req(i, 0.001, 1000, 1) for i in range(3)]
    trace.append(_req(3, 0.002, 3000, 1))
    reqs = _by_id(simulate(TINY, _pd(), trace, profile=simple_profile))
    assert reqs["r9"].first_token_s == pytest.approx(0.020)
    assert reqs["r0"].first_token_s == reqs["r1"].first_token_s == pytest.approx(0.020 + 0.210)
    assert reqs["r2"].first_token_s == pytest.approx(0.230 + 0.110)
    assert reqs["r3"].first_token_s == pytest.approx(0.340 + 0.310)  # alone, over the cap


def test_token_machine_queues_requests_whose_kv_does_not_fit(simple_profile):
    trace = [_req(0, 0.0, 1000, 20), _req(1, 0.0, 1000, 20)]
    groups = [MachineGroup(machine(1000), Pool.PREFILL, 1),
              MachineGroup(machine(1500), Pool.DECODE, 1)]
    reqs = _by_id(simulate(TINY, groups, trace, profile=simple_profile))
    # Each needs 1020 KV tokens and no machine holds two: r1 queues on the
    # token machine until r0 finishes, then decodes alone.
    assert reqs["r1"].decode_id == reqs["r0"].decode_id
    assert reqs["r1"].done_s == pytest.approx(reqs["r0"].done_s + 19 * 0.020)
    roomy = _by_id(simulate(TINY, _pd(kv=5000), trace, profile=simple_profile))
    assert roomy["r1"].done_s < roomy["r0"].done_s + 0.2  # decoded side by side


def test_cls_sends_decode_to_a_prompt_machine_when_token_memory_is_full(simple_profile):
    hw_small, hw_big = machine(1500), machine(100_000)
    groups = [MachineGroup(hw_big, Pool.PREFILL, 1), MachineGroup(hw_small, Pool.DECODE, 1)]
    trace = [_req(0, 0.0, 1000, 20), _req(1, 0.0, 1000, 20)]
    res = simulate(TINY, groups, trace, profile=simple_profile)
    reqs = _by_id(res)
    assert reqs["r1"].decode_id == "p0-0" and res.num_mixed_routes == 1


def test_prompt_overflow_runs_on_a_token_machine_from_the_mixed_pool(simple_profile):
    opts = SimOptions(SchedulerConfig(prefill_queue_threshold=1000))
    trace = [_req(i, 0.0, 1500, 3) for i in range(3)]
    res = simulate(TINY, _pd(), trace, opts, profile=simple_profile)
    reqs = _by_id(res)
    assert reqs["r0"].prefill_id.startswith("p")
    assert reqs["r1"].prefill_id.startswith("d") and reqs["r1"].decode_id == reqs["r1"].prefill_id
    assert res.num_mixed_routes >= 1
    assert all(r.done_s is not None for r in res.requests)


def test_jsq_spreads_simultaneous_prompts_over_prompt_machines(simple_profile):
    trace = [_req(i, 0.0, 1000, 2) for i in range(4)]
    res = simulate(TINY, _pd(n_p=2, n_d=2), trace, profile=simple_profile)
    assert {r.prefill_id for r in res.requests} == {"p0-0", "p0-1"}
    assert {r.decode_id for r in res.requests} == {"d1-0", "d1-1"}


def test_a_prompt_preempts_a_decode_on_a_mixed_machine_at_most_max_preemptions(simple_profile):
    trace = [_req(0, 0.0, 1000, 50), _req(1, 0.3, 1000, 50)]
    groups = [MachineGroup(machine(2000), Pool.MIXED, 1)]
    reqs = _by_id(simulate(TINY, groups, trace, SimOptions(max_preemptions=1),
                           profile=simple_profile))
    assert reqs["r0"].num_preemptions == 1
    assert reqs["r1"].first_token_s < reqs["r0"].done_s
    no_preempt = _by_id(simulate(TINY, groups, trace, SimOptions(max_preemptions=0),
                                 profile=simple_profile))
    assert no_preempt["r0"].num_preemptions == 0
    assert no_preempt["r1"].first_token_s > no_preempt["r0"].done_s


def test_baseline_machines_keep_prefill_and_decode_together(simple_profile):
    groups = [MachineGroup(machine(100_000), Pool.MIXED, 2)]
    res = simulate(TINY, groups, [_req(i, 0.01 * i, 200, 4) for i in range(6)],
                   profile=simple_profile)
    assert all(r.prefill_id == r.decode_id for r in res.requests)
    assert sum(m.num_mixed_iterations for m in res.machines) > 0


def test_a_time_limit_reports_unfinished_requests(simple_profile):
    res = simulate(TINY, _pd(), [_req(0, 0.0, 500, 1000)],
                   SimOptions(max_sim_s=0.5), profile=simple_profile)
    assert res.num_unfinished == 1


def test_chunked_prefill_fills_the_token_budget_and_finishes_the_split_prompt_first(simple_profile):
    # vLLM V1: max_num_batched_tokens=1000; r1-r3 (600 each) queue behind r0. Step 2 takes r1 and
    # 400 tokens of r2, step 3 the other 200 of r2 and all of r3 (10 ms + 0.1 ms/token each step).
    groups = [MachineGroup(machine(100_000), Pool.PREFILL, 1),
              MachineGroup(machine(100_000), Pool.DECODE, 1)]
    trace = [TraceRequest("r0", 0.0, 600, 2)] + [TraceRequest(f"r{i}", 0.001, 600, 2) for i in (1, 2, 3)]

    def first_tokens(chunked: bool) -> list[float]:
        opts = SimOptions(SchedulerConfig(None, None), prompt_token_cap=1000, chunked_prefill=chunked)
        res = simulate(TINY, groups, trace, opts, simple_profile)
        return [r.first_token_s for r in res.requests]

    assert first_tokens(True) == pytest.approx([0.070, 0.180, 0.270, 0.270])
    assert first_tokens(False) == pytest.approx([0.070, 0.140, 0.210, 0.280])  # Splitwise: whole prompts


def _jittered(ratios):
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    return parse_profile({**SIMPLE_PROFILE, "step_jitter": {"quantiles": [0.0, 0.5, 0.9, 1.0], "ratios": ratios}})


def _gaps(result):
    return sorted(b - a for r in result.requests for a, b in zip(r.token_times_s, r.token_times_s[1:]))


def test_measured_step_jitter_spreads_the_gaps_around_the_median_curve_and_replays_with_its_seed(simple_profile):
    """The curves are medians; the tail of a served trace's gaps comes from the measured spread."""
    trace, groups = [_req(0, 0.0, 100, 200)], _pd()
    flat = _gaps(simulate(TINY, groups, trace, profile=_jittered([1.0, 1.0, 1.0, 1.0])))
    assert flat == pytest.approx(_gaps(simulate(TINY, groups, trace, profile=simple_profile)))
    spread = _gaps(simulate(TINY, groups, trace, profile=_jittered([0.9, 1.0, 1.2, 2.0])))
    assert spread[len(spread) // 2] == pytest.approx(0.020, rel=0.05)  # decode curve: 20 ms at batch 1
    assert spread[-1] > 1.3 * flat[-1] and spread[0] < flat[0]
    assert spread == _gaps(simulate(TINY, groups, trace, profile=_jittered([0.9, 1.0, 1.2, 2.0])))
    again = simulate(TINY, groups, trace, SimOptions(seed=1), _jittered([0.9, 1.0, 1.2, 2.0]))
    assert _gaps(again) != spread


@pytest.mark.parametrize("bad", [{"quantiles": [0.5], "ratios": [1.0]}, {"quantiles": [0, 1], "ratios": [2.0, 1.0]},
                                 {"quantiles": [0, 1.5], "ratios": [1.0, 2.0]}, {"ratios": [1.0, 2.0]}])
def test_a_step_jitter_section_that_is_not_an_ascending_quantile_table_is_refused(bad):
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    with pytest.raises(ValueError, match="step_jitter"):
        parse_profile({**SIMPLE_PROFILE, "step_jitter": bad})


def _joining(ms):
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    return parse_profile({**SIMPLE_PROFILE, "decode_join": {"ms": ms}})


def test_the_decode_step_a_pushed_request_joins_in_costs_the_measured_join_time(simple_profile):
    """vLLM computes a pushed prompt's last token in the step it joins D's batch: a running request's
    gap over that step (and its own first step on D) is `decode_join` longer, every other gap not."""
    trace = [_req(0, 0.0, 100, 40), _req(1, 0.2, 100, 5)]
    def gaps_ms(profile):
        times = _by_id(simulate(TINY, _pd(), trace, profile=profile))["r0"].token_times_s
        return Counter(round(1e3 * (b - a), 6) for a, b in zip(times, times[1:]))

    base, joined = gaps_ms(simple_profile), gaps_ms(_joining(5.0))
    # r0's own join (KV transfer 5 ms + a 20 ms step), then r1's into a batch of two (21 ms)
    assert base - joined == Counter({25.0: 1, 21.0: 1}) and joined - base == Counter({30.0: 1, 26.0: 1})
    mixed = [MachineGroup(machine(100_000), Pool.MIXED, 1)]  # plain: a new request's prompt step is costed already
    assert (_by_id(simulate(TINY, mixed, trace, profile=_joining(5.0)))["r0"].token_times_s
            == _by_id(simulate(TINY, mixed, trace, profile=simple_profile))["r0"].token_times_s)


@pytest.mark.parametrize("bad", [{"ms": -1.0}, {"ms": "x"}, {"tries": []}])
def test_a_decode_join_section_without_a_non_negative_ms_is_refused(bad):
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    with pytest.raises(ValueError, match="decode_join"):
        parse_profile({**SIMPLE_PROFILE, "decode_join": bad})


def _beside_prefill(ratio):
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    return parse_profile({**SIMPLE_PROFILE, "decode_while_prefilling": {"ratio": ratio}})


def test_a_decode_step_beside_a_host_mates_prompt_step_takes_the_measured_ratio_longer(simple_profile):
    """P and D on one host share caches and memory: D's steps that start while P computes r1's prompt
    (0.2 to 0.31 s: 10 + 0.1 ms a token) are `decode_while_prefilling` times longer, no other step is;
    machines that do not share a host (the option off) ignore the ratio."""
    trace = [_req(0, 0.0, 100, 40), _req(1, 0.2, 1000, 2)]
    def gaps(profile, shared):
        result = simulate(TINY, _pd(), trace, SimOptions(shared_host=shared), profile)
        times = _by_id(result)["r0"].token_times_s
        return [(a, b - a) for a, b in zip(times, times[1:])]

    host, base = gaps(_beside_prefill(1.5), True), gaps(simple_profile, True)
    beside = [g for a, g in host if 0.2 <= a < 0.31]
    assert len(beside) >= 4 and all(abs(g - 0.030) < 1e-9 for g in beside)
    assert [g for a, g in host if a < 0.2] == [g for a, g in base if a < 0.2]
    assert gaps(_beside_prefill(1.5), False) == base


def test_a_decode_step_beside_a_prompt_step_draws_from_the_spread_measured_there(simple_profile):
    """Where the profile measured the spread beside a prefill (`decode_while_prefilling.step_jitter`),
    those steps draw from it (here: always 2x) in place of the idle spread times the ratio (1.5);
    steps with no prompt step beside them keep the idle draw."""
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    trace = [_req(0, 0.0, 100, 40), _req(1, 0.2, 1000, 2)]
    section = {"ratio": 1.5, "step_jitter": {"quantiles": [0.0, 1.0], "ratios": [2.0, 2.0]}}
    profile = parse_profile({**SIMPLE_PROFILE, "decode_while_prefilling": section})
    assert profile.prefill_step_jitter == ((0.0, 1.0), (2.0, 2.0))
    times = _by_id(simulate(TINY, _pd(), trace, SimOptions(shared_host=True), profile))["r0"].token_times_s
    base = _by_id(simulate(TINY, _pd(), trace, SimOptions(shared_host=True), simple_profile))["r0"].token_times_s
    gaps = [(a, b - a) for a, b in zip(times, times[1:])]
    assert all(abs(g - 0.040) < 1e-9 for a, g in gaps if 0.2 <= a < 0.31)
    assert [g for a, g in gaps if a < 0.2] == [b - a for a, b in zip(base, base[1:]) if a < 0.2]
    with pytest.raises(ValueError, match="decode_while_prefilling.step_jitter"):
        parse_profile({**SIMPLE_PROFILE, "decode_while_prefilling": {"ratio": 1.5, "step_jitter": {"ratios": [1]}}})


@pytest.mark.parametrize("bad", [{"ratio": 0.0}, {"ratio": "x"}, {"ratio": 9.0}, {"ratios": [1.1]}])
def test_a_decode_while_prefilling_section_without_a_step_time_ratio_is_refused(bad):
    from planner_fixtures import SIMPLE_PROFILE

    from vllm_disagg.planner.profile import parse_profile

    with pytest.raises(ValueError, match="decode_while_prefilling"):
        parse_profile({**SIMPLE_PROFILE, "decode_while_prefilling": bad})
