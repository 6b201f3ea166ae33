# SPDX-License-Identifier: Apache-2.0
"""serve_fold (benchmarks/serve_fold.py) on known runs: the headline is the median of the runs' worst
errors, the per-probe figure compares medians, and the repeatability floor scores one run's measurement
against another's over the probes both kept up at."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serve_fold import fold, per_probe, repeatability, replay_repeatability  # noqa: E402

KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms", "tbt_p99_ms")


def _row(dep, rate, measured_ttft, predicted_ttft, kept_up=True, goodput=0.9):
    measured = {k: 100.0 for k in KEYS} | {"ttft_p50_ms": measured_ttft, "goodput": goodput}
    predicted = {k: 100.0 for k in KEYS} | {"ttft_p50_ms": predicted_ttft, "goodput": goodput}
    error = {k: (predicted[k] - measured[k]) / measured[k] for k in KEYS} | {"goodput": 0.0}
    return {"deployment": dep, "rate": rate, "window_size": 20, "kept_up": kept_up, "measured": measured,
            "predicted": predicted, "error": error}


def _run(measured_ttft, predicted_ttft, saturated_ttft=1000.0):
    rows = [_row("ours_tcp", 0.15, measured_ttft, predicted_ttft),
            _row("ours_tcp", 0.77, saturated_ttft, 100.0, kept_up=False)]  # a saturated probe never counts
    worst = max(abs(e) for r in rows if r["kept_up"] for e in r["error"].values())
    return {"prediction": {"rows": rows}, "planner_max_error": worst, "trace": {"start": 0},
            "plan": {"num_requests": 20}}


def test_repeatability_scores_each_runs_measurement_against_the_others():
    runs = [_run(100.0, 100.0), _run(110.0, 100.0), _run(125.0, 100.0)]
    floor = repeatability(runs)
    # ordered pairs: 100 vs 110 -> -0.0909, 100 vs 125 -> -0.2, 110 vs 100 -> 0.1, 110 vs 125 -> -0.12,
    # 125 vs 100 -> 0.25, 125 vs 110 -> 0.136; median of the magnitudes (0.12, 0.136) -> 0.128
    assert floor["median"] == pytest.approx((0.12 + 15 / 110) / 2, abs=1e-4)
    assert len(floor["pairs"]) == 6
    assert {p["worst"]["key"] for p in floor["pairs"]} == {"ttft_p50_ms"}


def test_a_probe_one_run_saturated_at_is_left_out_of_the_floor():
    a, b = _run(100.0, 100.0), _run(100.0, 100.0)
    b["prediction"]["rows"][0]["kept_up"] = False
    assert repeatability([a, b]) is None


def test_per_probe_compares_the_median_prediction_with_the_median_measurement():
    worst = per_probe([_run(100.0, 90.0), _run(120.0, 96.0), _run(110.0, 130.0)])
    assert worst["key"] == "ttft_p50_ms"
    assert worst["error"] == pytest.approx(96.0 / 110.0 - 1, abs=1e-4)


def test_fold_takes_the_median_of_the_runs_worst_errors():
    out = fold({"r1.json": _run(100.0, 90.0), "r2.json": _run(100.0, 120.0), "r3.json": _run(100.0, 130.0)})
    assert out["planner_max_error"] == pytest.approx(0.2)
    assert [r["worst"]["error"] for r in out["planner_max_error_runs"]] == pytest.approx([-0.1, 0.2, 0.3])
    assert out["planner_measurement_repeatability"] == 0.0  # the three measured the same
    assert out["planner_measurement_repeatability_pairs"][0]["as_prediction"] == "r1.json"


def _replayed_run(ttfts_by_probe: dict[tuple[str, float], list[float]], kept: set) -> dict:
    rows = [_row(dep, rate, 100.0, 100.0, kept_up=(dep, rate) in kept) for dep, rate in ttfts_by_probe]
    replays = [{"deployment": dep, "rate": rate, "window_size": 20, "kind": "bisect", "replay": i,
                "goodput": {"ttft5s_gap200ms": 0.9}} | {k: 100.0 for k in KEYS} | {"ttft_p50_ms": ttft}
               for (dep, rate), ttfts in ttfts_by_probe.items() for i, ttft in enumerate(ttfts)]
    return {"prediction": {"rows": rows}, "runs": replays}


def test_replay_repeatability_compares_the_replays_of_one_run_over_kept_probes():
    run = _replayed_run({("ours_tcp", 0.15): [100.0, 120.0], ("ours_tcp", 0.77): [100.0, 300.0]},
                        kept={("ours_tcp", 0.15)})
    within = replay_repeatability(run)
    # 100 as the prediction of 120: -0.1667; 120 of 100: +0.2; the saturated probe's 3x is left out
    assert [p["worst"]["error"] for p in within["pairs"]] == pytest.approx([-0.1667, 0.2], abs=1e-4)
    assert within["median"] == pytest.approx((0.1667 + 0.2) / 2, abs=1e-4)


def test_a_run_of_single_replays_has_no_replay_floor():
    assert replay_repeatability(_replayed_run({("ours_tcp", 0.15): [100.0]}, kept={("ours_tcp", 0.15)})) is None
