# SPDX-License-Identifier: Apache-2.0
"""serve_bench's rate search on known inputs: a probe replays about `probe_cap_s` of arrivals, the
rounds' full-window runs (not the probes) narrow the bracket, ratios are None unless both searches
found a rate (with a lower bound when only the baseline failed everywhere), the headline rate is
probed first only when no round measured it, and the planner predicts each probe's own sub-window."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serve_bench import Plan, bisect_names, listed  # noqa: E402
from serve_bisect import as_plain, known_goodputs, probe_window, rate_bound, rate_ratio, search_rates  # noqa: E402
from serve_predict import predict  # noqa: E402

from vllm_disagg.planner.goodput import HEADLINE_SLO  # noqa: E402
from vllm_disagg.planner.traces import TraceRequest  # noqa: E402

WINDOW = [TraceRequest(req_id=str(i), arrival_s=float(i), num_prompt_tokens=100 + i, num_output_tokens=10) for i in range(30)]


@pytest.mark.parametrize(("rate", "num"), [(0.0375, 8), (0.1, 15), (0.15, 22), (1.0, 30)])
def test_a_probe_replays_about_the_cap_of_arrivals_with_a_floor_and_the_window_as_ceiling(rate, num):
    got = probe_window(WINDOW, rate, cap_s=150.0, min_requests=8)
    assert got == WINDOW[:num]


def _row(dep: str, rate: float, goodput: float, size: int = 30) -> dict:
    return {"deployment": dep, "rate": rate, "num_requests": size, "window_size": size,
            "goodput": {HEADLINE_SLO.key: goodput}}


def test_only_full_window_runs_of_the_deployment_narrow_the_bracket():
    runs = [_row("plain", 0.15, 0.4), _row("plain", 0.15, 0.6), _row("plain", 0.15, 0.5),
            _row("plain", 0.05, 1.0, size=8), _row("ours", 0.15, 0.9)]
    assert known_goodputs(runs, "plain", 30) == {0.15: 0.5}


def test_the_headline_rate_is_probed_first_only_when_no_round_measured_the_deployment():
    plan = Plan(rate=0.2, saturation_rate=1.0, bisect_steps=2)
    probed = []

    def probe(rate: float) -> float:  # a deployment that keeps up to 0.5 req/s
        probed.append(rate)
        return 1.0 if rate <= 0.5 else 0.3

    alone = search_rates(plan, {}, probe)
    assert probed[0] == 0.2 and alone["seeded"] == [{"rate": 0.2, "goodput": 1.0}]
    assert 0.2 <= alone["max_rate"] <= 0.5 < alone["min_failing_rate"]
    probed.clear()
    after_rounds = search_rates(plan, {0.2: 0.95}, probe)
    assert 0.2 not in probed and after_rounds["seeded"] == []
    assert [p["rate"] for p in after_rounds["probes"]] == probed


def test_rate_ratio_needs_both_rates_and_a_baseline_that_failed_everywhere_gives_a_lower_bound():
    rates = {"ours_tcp": {"max_rate": 0.3}, "plain": {"max_rate": 0.1},
             "vllm_nixl": {"max_rate": None, "below": 0.0375, "min_failing_rate": 0.0375}}
    assert rate_ratio(rates, "ours_tcp", "plain") == pytest.approx(3.0)
    assert rate_bound(rates, "ours_tcp", "plain") is None
    assert rate_ratio(rates, "ours_tcp", "vllm_nixl") is None
    assert rate_ratio(rates, "ours_tcp", "vllm_nixl", bound_ok=True) == pytest.approx(8.0)
    assert rate_bound(rates, "ours_tcp", "vllm_nixl")["at_least"] == pytest.approx(8.0)
    assert rate_bound({"ours_tcp": {"max_rate": None, "below": 0.03}, **rates}, "ours_tcp", "plain") is None


def _profile() -> dict:
    return {"schema": "vllm-disagg-profile/1", "prefill_fit": "piecewise",
            "prefill": [{"num_tokens": 0, "ms": 10.0}, {"num_tokens": 1000, "ms": 110.0}],
            "decode": [{"batch_size": 1, "ms": 20.0}, {"batch_size": 101, "ms": 120.0}],
            "machine": {"kv_capacity_tokens": 40_000, "max_num_batched_tokens": 2048, "chunked_prefill": True,
                        "layerwise_min_tokens": 0, "first_token_on": "decode", "kv_layerwise_overhead_ms": 0.0}}


def _measured(rate: float, size: int, tok_s: float) -> dict:
    return _row("plain_bind01", rate, 1.0, size) | {
        "ttft_p50_ms": 50.0, "ttft_p90_ms": 60.0, "tbt_p50_ms": 20.0, "tbt_p99_ms": 22.0, "output_tok_s": tok_s}


def test_a_search_named_after_the_chosen_plain_binding_is_the_plain_baselines():
    rates = {"ours_tcp": {"max_rate": 1.2}, "plain_bind01": {"max_rate": 0.4}}
    assert rate_ratio(as_plain(rates, "plain_bind01"), "ours_tcp", "plain") == pytest.approx(3.0)
    assert rate_ratio(as_plain(rates, "plain_default"), "ours_tcp", "plain") is None  # not the baseline's
    assert as_plain(rates, None) is rates
    both = rates | {"plain": {"max_rate": 0.5}}  # a search of its own under 'plain' wins
    assert rate_ratio(as_plain(both, "plain_bind01"), "ours_tcp", "plain") == pytest.approx(2.4)


def test_the_planner_predicts_each_probe_on_the_sub_window_it_replayed(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 128, "vocab_size": 256, "head_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    runs = [_measured(0.1, 8, 1.0), _measured(0.1, 30, 0.5), _measured(1.0, 30, 10.0)]
    out = predict(runs, WINDOW, {"plain_bind01": _profile()}, str(tmp_path), "plain_bind01")
    rows = {(r["rate"], r["window_size"]): r for r in out["rows"]}
    assert rows.keys() == {(0.1, 8), (0.1, 30), (1.0, 30)}
    assert rows[(0.1, 8)]["kept_up"] and not rows[(0.1, 30)]["kept_up"]  # 0.9 x 0.1 req/s x 10 tokens
    assert rows[(0.1, 8)]["predicted"]["goodput"] == 1.0
    assert out["max_abs_error_below_saturation"] is not None
    # goodput at every SLO of the grid that a run measured (here the headline's only), below saturation
    assert rows[(0.1, 8)]["goodput_by_slo"] == {HEADLINE_SLO.key: {"measured": 1.0, "predicted": 1.0}}
    assert out["goodput_error_by_slo_below_saturation"] == {HEADLINE_SLO.key: 0.0}


def test_a_flag_naming_an_unknown_deployment_fails_with_one_line_instead_of_dropping_it(capsys):
    parser = argparse.ArgumentParser()
    assert listed(parser, "--bisect", "plain,ours_tcp", bisect_names(["plain_bind01", "ours_tcp"])) == ["plain", "ours_tcp"]
    with pytest.raises(SystemExit):
        listed(parser, "--bisect", "plain,ours_tpc", bisect_names(["plain_bind01", "ours_tcp"]))
    assert "--bisect: unknown ours_tpc (known here: plain, plain_bind01, ours_tcp)" in capsys.readouterr().err
    assert bisect_names(["ours_tcp"]) == ["ours_tcp"]


def test_each_replay_of_a_probe_gets_prompt_ids_of_its_own_and_replay_0_keeps_the_old_ones():
    from serve_bench import IDS_PER_RUN, MAX_PROBE_REPLAYS, first_id

    starts = [first_id(-1, "bisect", 0.5138, replay=i) for i in range(MAX_PROBE_REPLAYS)]
    assert starts[0] == first_id(-1, "bisect", 0.5138)
    assert all(b - a == IDS_PER_RUN // MAX_PROBE_REPLAYS for a, b in zip(starts, starts[1:]))
    assert starts[-1] + IDS_PER_RUN // MAX_PROBE_REPLAYS <= first_id(-1, "bisect", 0.5139)  # the next rate's ids
    with pytest.raises(ValueError, match="replay"):
        first_id(-1, "bisect", 0.5, replay=MAX_PROBE_REPLAYS)


def test_a_probe_with_replays_runs_each_on_its_own_prompts_and_scores_their_median():
    from types import SimpleNamespace

    from serve_bisect import search

    goodputs = iter([0.5, 1.0, 0.9] * 10)
    seen = []

    def run_once(running, rate, round_idx, kind, window, replay=0):
        seen.append((rate, replay))
        return {"goodput": {HEADLINE_SLO.key: next(goodputs)}}

    bench = SimpleNamespace(plan=Plan(rate=0.2, saturation_rate=1.0, bisect_steps=1, probe_replays=3),
                            trace={"requests": WINDOW}, runs=[], max_rates={}, run_once=run_once)
    search(bench, "ours", "ours_tcp", running=None)
    assert seen[:3] == [(0.2, 0), (0.2, 1), (0.2, 2)]
    assert bench.max_rates["ours"]["seeded"] == [{"rate": 0.2, "goodput": 0.9}]  # median of 0.5, 1.0, 0.9
