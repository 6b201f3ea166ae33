# SPDX-License-Identifier: Apache-2.0
"""Synthetic traces match the papers' statistics; Azure CSVs parse."""

import pytest

from vllm_disagg.planner.traces import (
    describe,
    load_azure_csv,
    rescale_rate,
    synthetic_trace,
)


@pytest.mark.parametrize("kind,p_med,p_mean,o_med,o_mean", [
    ("coding", 1500, 2047.8, 13, 27.9), ("conversation", 1020, 1154.7, 129, 211.1)])
def test_synthetic_traces_match_splitwise_medians_and_lamina_means(kind, p_med, p_mean,
                                                                   o_med, o_mean):
    s = describe(synthetic_trace(kind, rps=50, num_requests=40000, seed=1))
    assert s["prompt_median"] == pytest.approx(p_med, rel=0.03)
    assert s["prompt_mean"] == pytest.approx(p_mean, rel=0.05)
    assert s["output_median"] == pytest.approx(o_med, rel=0.08)
    assert s["output_mean"] == pytest.approx(o_mean, rel=0.08)
    assert s["rps"] == pytest.approx(50, rel=0.03)


def test_the_same_seed_gives_the_same_trace():
    a = synthetic_trace("coding", 10, duration_s=20, seed=7)
    assert a == synthetic_trace("coding", 10, duration_s=20, seed=7)
    assert a != synthetic_trace("coding", 10, duration_s=20, seed=8)


def test_azure_csv_rows_become_requests_relative_to_the_first_arrival(tmp_path):
    path = tmp_path / "AzureLLMInferenceTrace_code.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,4808,10\n"
                    "2023-11-16 18:15:50.9951690,3180,8\n"
                    "2023-11-16 18:15:47.0000000,110,27\n")
    trace = load_azure_csv(path)
    assert [r.num_prompt_tokens for r in trace] == [4808, 110, 3180]
    assert trace[0].arrival_s == 0 and trace[2].arrival_s == pytest.approx(4.3145789, abs=1e-6)
    fast = rescale_rate(trace, rps=3.0)
    assert fast[-1].arrival_s == pytest.approx(1.0)


def test_a_malformed_azure_row_is_reported_with_the_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-time,1,x\n")
    with pytest.raises(ValueError, match="bad.csv"):
        load_azure_csv(path)


@pytest.mark.parametrize("kind,p_mean,p_std,o_mean,o_std", [
    ("splitwise", 1155, 1109, 211, 163), ("lmsys", 102, 169, 222, 210),
    ("sharegpt", 246, 547, 322, 244)])
def test_nanoflow_table3_datasets_match_their_mean_and_spread(kind, p_mean, p_std, o_mean, o_std):
    import numpy as np

    trace = synthetic_trace(kind, rps=10, num_requests=60000, seed=2)
    p = np.array([r.num_prompt_tokens for r in trace])
    o = np.array([r.num_output_tokens for r in trace])
    assert p.mean() == pytest.approx(p_mean, rel=0.06)
    assert o.mean() == pytest.approx(o_mean, rel=0.06)
    assert p.std() == pytest.approx(p_std, rel=0.25)  # heavy tails: loose on spread
    assert o.std() == pytest.approx(o_std, rel=0.25)


def _sizes(trace):
    import numpy as np

    return np.array([r.num_prompt_tokens for r in trace])


def test_coding_lengths_follow_the_azure_trace_shape_not_just_its_median_and_mean():
    import numpy as np

    emp = _sizes(synthetic_trace("coding", rps=50, num_requests=40000, seed=1))
    logn = _sizes(synthetic_trace("coding-lognormal", rps=50, num_requests=40000, seed=1))
    # Azure code trace: 16 % of prompts under 256 tokens, 10 % over 5187, 99th pct 7436.
    assert (emp < 256).mean() == pytest.approx(0.16, abs=0.015)
    assert np.percentile(emp, 90) == pytest.approx(5187, rel=0.03)
    assert emp.max() <= 7437
    # The log-normal with the same median and mean has almost no short prompts.
    assert (logn < 256).mean() < 0.03


def test_poisson_resampling_keeps_the_csv_sizes_and_draws_the_rate():
    from vllm_disagg.planner.traces import TraceRequest, resample_poisson

    base = [TraceRequest("a", 0.0, 100, 3), TraceRequest("b", 9.0, 7000, 11)]
    trace = resample_poisson(base, rps=40.0, duration_s=50.0, seed=3)
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in trace} == {(100, 3), (7000, 11)}
    assert describe(trace)["rps"] == pytest.approx(40.0, rel=0.05)


def test_a_window_is_rebased_capped_and_becomes_timed_trace_lines_with_unique_ids():
    import json

    from vllm_disagg.planner.traces import TraceRequest, cap_lengths, timed_trace_lines, trace_window

    trace = [TraceRequest(f"r{i}", 10.0 + i, p, o) for i, (p, o) in enumerate([(40, 5), (3000, 900), (17, 1), (100, 8)])]
    window = trace_window(trace, 1, 3)
    assert [r.arrival_s for r in window] == [0.0, 1.0, 2.0]
    capped = cap_lengths(window, max_model_len=2048, max_output_tokens=512)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in capped] == [(1536, 512), (17, 1), (100, 8)]
    lines = [json.loads(x) for x in timed_trace_lines(capped, chunk_tokens=16, first_id=1000)]
    assert [x["input_length"] for x in lines] == [1536, 17, 100]
    assert [x["output_length"] for x in lines] == [512, 1, 8]
    assert [len(x["hash_ids"]) for x in lines] == [96, 2, 7]  # ceil(n / 16): none empty, none shared
    ids = [i for x in lines for i in x["hash_ids"]]
    assert len(set(ids)) == len(ids) and min(ids) == 1000
    with pytest.raises(ValueError, match="outside"):
        trace_window(trace, 2, 3)


def test_rescaling_a_window_keeps_its_burst_shape():
    from vllm_disagg.planner.traces import TraceRequest, rescale_rate

    trace = [TraceRequest(str(i), t, 10, 1) for i, t in enumerate([0.0, 0.1, 0.2, 5.0, 10.0])]
    slow = rescale_rate(trace, rps=0.5)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(slow, slow[1:])]
    assert slow[-1].arrival_s == pytest.approx(10.0)
    assert gaps[0] == pytest.approx(gaps[1]) and gaps[2] == pytest.approx(48 * gaps[0])


def test_the_representative_window_has_the_trace_medians():
    from vllm_disagg.planner.traces import TraceRequest, describe, representative_window, trace_window

    short = [TraceRequest(str(i), float(i), 100, 10) for i in range(20)]
    typical = [TraceRequest(str(i), float(i), 1000 + i, 100) for i in range(20, 60)]
    trace = short + typical
    start = representative_window(trace, 10)
    assert start >= 20 and describe(trace_window(trace, start, 10))["prompt_median"] > 1000
