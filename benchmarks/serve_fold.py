# SPDX-License-Identifier: Apache-2.0
"""The planner's headline from several runs of the same bisection, and how far the measurement itself
moves between those runs (issue 14, `planner_max_error`).

`planner_max_error` is the median over runs of each run's worst error below saturation (serve_predict).
Beside it, `planner_measurement_repeatability` asks what a perfect planner could score: each run's
measurement taken as the "prediction" of another run's, over the probes both kept up at, with the same
error definition (relative for TTFT/TBT percentiles, absolute for goodput); the worst row per ordered
pair of runs, then the median over pairs. A 20-request window's P90 TTFT is its 18th request, and a
TBT P99 rests on a few requests' tails, so replays of one window on one box differ by that much before
the planner is asked anything. `planner_max_error_median_per_probe` compares the median prediction with
the median measurement per probe over the runs. A run of `serve_bench.py --probe-replays K` replays each
probe K times and predicts their median; `planner_replay_repeatability_runs` gives the same floor
between the replays of one run.

    python benchmarks/serve_fold.py results/serve_bench_bisect_r11.json _r12.json _r13.json   # print
    python benchmarks/serve_fold.py r11.json r12.json r13.json --into results/serve_bench_bisect.json

`--into` writes these keys into that file's secondary keys, and nothing else.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

from serve_predict import COMPARED, _error, _get

Probe = tuple[str, float, int]  # deployment, rate, window size


def _rows(run: dict) -> dict[Probe, dict]:
    return {(row["deployment"], round(row["rate"], 4), row["window_size"]): row for row in run["prediction"]["rows"]}


def _worst(errors: list[tuple[float, Probe, str]]) -> dict | None:
    if not errors:
        return None
    value, (dep, rate, _), key = max(errors, key=lambda e: abs(e[0]))
    return {"deployment": dep, "rate": rate, "key": key, "error": round(value, 4)}


def run_worst(run: dict) -> dict | None:
    """The run's worst error below saturation, as serve_predict scored it."""
    return _worst([(e, probe, k) for probe, row in _rows(run).items() if row["kept_up"]
                   for k, e in row["error"].items() if e is not None])


def _floor(measures: list[dict[Probe, dict]]) -> dict | None:
    """Each measurement (probe -> figures) as the prediction of each other one, per ordered pair, over
    the probes both have: the worst row per pair and the median over pairs (None: no pair shares one)."""
    pairs = []
    for (i, a), (j, b) in itertools.permutations(enumerate(measures), 2):
        errors = [(e, p, k) for p in a.keys() & b.keys() for k in COMPARED
                  if (e := _error(k, a[p].get(k), b[p].get(k))) is not None]
        if errors:
            pairs.append({"as_prediction": i, "measured": j, "worst": _worst(errors)})
    if not pairs:
        return None
    return {"median": statistics.median(abs(p["worst"]["error"]) for p in pairs), "pairs": pairs}


def repeatability(runs: list[dict]) -> dict | None:
    """The worst error of one run's measurement against another's, per ordered pair, over the probes
    both runs kept up at; the median over pairs is the floor a planner meets at best."""
    return _floor([{p: row["measured"] for p, row in _rows(run).items() if row["kept_up"]} for run in runs])


def replay_repeatability(run: dict) -> dict | None:
    """The same floor within one run of `--probe-replays K`: replay i's measurement as the prediction of
    replay j's, per ordered pair, over the probes kept up at (a probe's replays follow one another on one
    engine, so this leaves out what differs between engine starts and calibrations)."""
    kept = {probe for probe, row in _rows(run).items() if row["kept_up"]}
    by_replay: dict[int, dict[Probe, dict]] = {}
    for row in run.get("runs", []):
        probe = (row["deployment"], round(row["rate"], 4), row.get("window_size"))
        if row.get("kind") == "bisect" and probe in kept:
            by_replay.setdefault(row.get("replay", 0), {})[probe] = {k: _get(row, k) for k in COMPARED}
    return _floor([by_replay[i] for i in sorted(by_replay)])


def per_probe(runs: list[dict]) -> dict | None:
    """The median prediction against the median measurement per probe, over probes every run replayed
    and most runs kept up at; the worst row."""
    by: dict[Probe, list[dict]] = {}
    for run in runs:
        for probe, row in _rows(run).items():
            by.setdefault(probe, []).append(row)
    errors = []
    for probe, rows in by.items():
        if len(rows) < len(runs) or 2 * sum(r["kept_up"] for r in rows) <= len(rows):
            continue
        for k in COMPARED:
            meas = [r["measured"][k] for r in rows if r["measured"][k] is not None]
            pred = [r["predicted"][k] for r in rows if r["predicted"][k] is not None]
            if meas and pred and (e := _error(k, statistics.median(pred), statistics.median(meas))) is not None:
                errors.append((e, probe, k))
    return _worst(errors)


def fold(runs: dict[str, dict]) -> dict:
    """The planner keys of several runs of one bisection (`runs`: file name -> result)."""
    results, names = list(runs.values()), [Path(name).name for name in runs]
    errors = {name: r["planner_max_error"] for name, r in runs.items()}
    floor, probe = repeatability(results), per_probe(results)
    within = {name: replay_repeatability(r) for name, r in runs.items()}
    return {
        "planner_max_error": statistics.median(errors.values()),
        "planner_max_error_runs": [{"file": name, "planner_max_error": errors[name], "worst": run_worst(r),
                                    "loadavg": [r.get("load_first"), r.get("load_last")]}
                                   for name, r in runs.items()],
        "planner_max_error_median_per_probe": abs(probe["error"]) if probe else None,
        "planner_max_error_median_per_probe_worst": probe,
        "planner_measurement_repeatability": floor["median"] if floor else None,
        "planner_measurement_repeatability_pairs": [
            {"as_prediction": names[p["as_prediction"]], "measured": names[p["measured"]], "worst": p["worst"]}
            for p in floor["pairs"]] if floor else [],
        "planner_replay_repeatability_runs": {Path(name).name: w["median"] for name, w in within.items() if w},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="result JSONs of the same bisection")
    parser.add_argument("--into", type=Path, default=None, help="headline JSON whose secondary keys get the fold")
    args = parser.parse_args()
    runs = {str(p): json.loads(p.read_text()) for p in args.runs}
    if len({(r["trace"]["start"], r["plan"]["num_requests"]) for r in runs.values()}) != 1:
        raise SystemExit("serve_fold: the runs replayed different trace windows")
    folded = fold(runs)
    print(json.dumps({k: v for k, v in folded.items() if not isinstance(v, list)}, indent=1))
    if args.into:
        head = json.loads(args.into.read_text())
        sec = head.setdefault("secondary", {})
        known = {e["file"]: e for e in sec.get("planner_max_error_runs", [])}  # keep what an earlier fold noted
        folded["planner_max_error_runs"] = [{**known.get(e["file"], {}), **e} for e in folded["planner_max_error_runs"]]
        sec.update({k: v for k, v in folded.items() if k != "planner_max_error"})
        head["planner_max_error"] = folded["planner_max_error"]
        args.into.write_text(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
