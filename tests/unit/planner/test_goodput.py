# SPDX-License-Identifier: Apache-2.0
"""Serving metrics on known inputs: every gap counts, failures are never good, bisection brackets the rate."""

from __future__ import annotations

import pytest

from vllm_disagg.planner.goodput import (
    ServedRequest,
    Slo,
    bisect_max_rate,
    from_bench_detailed,
    from_token_times,
    goodput,
    summarize,
)


def test_vllm_bench_detailed_output_becomes_requests_and_errors_are_failures():
    result = {"ttfts": [0.5, 0.0, 2.0], "itls": [[0.1, 0.3], [], [0.05]], "errors": ["", "boom", ""]}
    reqs = from_bench_detailed(result)
    assert [r.ok for r in reqs] == [True, False, True]
    assert reqs[0].gaps_s == (0.1, 0.3) and reqs[0].worst_gap_s == 0.3 and reqs[0].num_output_tokens == 3
    with pytest.raises(ValueError, match="save-detailed"):
        from_bench_detailed({"completed": 3})


def test_goodput_needs_the_ttft_and_every_gap_within_the_slo():
    slo = Slo(ttft_s=1.0, gap_s=0.2)
    reqs = [ServedRequest(0.5, (0.1,) * 50),           # good
            ServedRequest(0.5, (0.1,) * 49 + (0.25,)),  # one stall: its mean gap is 0.103 s, still not good
            ServedRequest(1.5, (0.1,)),                 # late first token
            ServedRequest(None)]                        # failed
    assert goodput(reqs, slo) == 0.25
    assert slo.key == "ttft1s_gap200ms"
    assert goodput([], slo) is None


def test_summary_percentiles_run_over_every_gap_of_every_request():
    reqs = [ServedRequest(1.0, (0.1, 0.1, 0.1)), ServedRequest(3.0, (0.2, 1.0)), ServedRequest(None)]
    s = summarize(reqs, duration_s=10.0, slos=(Slo(5.0, 0.5),))
    assert s["num_requests"] == 3 and s["num_failed"] == 1 and s["num_gaps"] == 5
    assert s["output_tokens"] == 7 and s["output_tok_s"] == pytest.approx(0.7)
    assert s["ttft_p50_ms"] == pytest.approx(2000.0) and s["ttft_mean_ms"] == pytest.approx(2000.0)
    assert s["tbt_p50_ms"] == pytest.approx(100.0)  # gaps 0.1, 0.1, 0.1, 0.2, 1.0
    assert s["tbt_p99_ms"] == pytest.approx(1e3 * (0.2 + 0.96 * 0.8))
    assert s["worst_gap_p50_ms"] == pytest.approx(550.0)
    assert s["goodput"] == {"ttft5s_gap500ms": pytest.approx(1 / 3)}


def test_token_times_give_the_ttft_and_gaps():
    req = from_token_times(10.0, [10.5, 10.6, 11.0])
    assert req.ttft_s == pytest.approx(0.5) and req.gaps_s == pytest.approx((0.1, 0.4))
    assert not from_token_times(1.0, []).ok


def test_bisection_finds_the_highest_rate_that_keeps_the_target():
    probed = []

    def probe(rate):  # goodput falls below 90 % above 0.3 req/s
        probed.append(rate)
        return 1.0 if rate <= 0.3 else 0.5

    out = bisect_max_rate(probe, lo=0.05, hi=1.0, steps=6, known={0.2: 0.95})
    assert 0.25 < out["max_rate"] <= 0.3 < out["min_failing_rate"] < 0.36
    assert 0.2 not in probed and len(out["probes"]) == len(probed)
    none = bisect_max_rate(lambda r: 0.1, lo=0.05, hi=1.0)
    assert none["max_rate"] is None and none["below"] == 0.05
    assert bisect_max_rate(lambda r: 1.0, lo=0.05, hi=1.0)["max_rate"] == 1.0
