# SPDX-License-Identifier: Apache-2.0
"""Serving benchmark on a real trace (issue 14): what P/D buys a user against plain vLLM and vLLM's own P/D.

A window of the Azure LLM inference trace (conversation; code with --trace code), rescaled to a target
rate with its burst shape kept and its lengths capped to the model, is replayed by vLLM's own client
(`vllm bench serve --dataset-name timed_trace --ignore-eos --save-detailed`, PYTHONHASHSEED=0) against
each deployment of serve_deploy.py, one at a time, on the same two cores (client and router too).
Per deployment and rate: TTFT P50/P90/P99, TBT over every gap P50/P99/P99.9 and each request's worst
gap, output tok/s, goodput on an SLO grid (TTFT and every gap within the SLO), vLLM's own `--goodput`
(`goodput_tpot`), where TTFT goes, and for P/D whether the KV really moved (a NIXL run that moved no
bytes or made D recompute fails the benchmark). The full run repeats every deployment in paired
rounds (same window, same rates, rotating order) and reports medians; it also runs a saturation rate
(throughput) and bisects the highest rate that keeps >= 90 % goodput. The planner's prediction of the
same window is compared with the measurement (serve_predict.py).

    python benchmarks/serve_bench.py --quick   # <= 15 min: plain (both bindings) + ours_tcp, one rate, one round
    python benchmarks/serve_bench.py           # full: 3 rounds, 6 deployments, saturation, bisection (~2 h)
Writes results/serve_bench{_quick}.json and .png; prints the goal keys as one JSON object.
The trace CSVs are read from --trace-dir (see benchmarks/data/README.md for where to get them).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_bisect import bisect, search  # noqa: E402
from serve_deploy import DEPLOYMENTS, engine_dtype, started  # noqa: E402
from serve_import import import_keys  # noqa: E402
from serve_run import log, measure, warm_up  # noqa: E402
from serve_summary import medians, pick_plain, summary  # noqa: E402

from vllm_disagg.planner.goodput import HEADLINE_SLO  # noqa: E402
from vllm_disagg.planner.traces import (  # noqa: E402
    TraceRequest,
    cap_lengths,
    describe,
    load_azure_csv,
    representative_window,
    rescale_rate,
    synthetic_trace,
    timed_trace_lines,
    trace_window,
)

RESULTS = Path(__file__).parent / "results"
TRACE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
DEFAULT_TRACE_DIR = Path(os.environ.get("VLLM_DISAGG_TRACE_DIR", Path.home() / ".cache/vllm-disagg/traces"))
HEADLINE_RATE = 0.2
"""req/s where plain vLLM keeps 30-70 % goodput on the conversation window (checked in every run)."""
SATURATION_RATE = 1.0
"""Above every deployment's capacity here (~0.3-0.6 req/s): throughput is what each can do."""
GOAL_KEYS = ("goodput_ratio_vs_plain", "max_rate_ratio_vs_plain", "p99_tbt_ratio_vs_plain", "ttft_p50_ratio_vs_plain",
             "throughput_ratio_vs_plain", "goodput_ratio_vs_vllm_nixl", "max_rate_ratio_vs_vllm_nixl",
             "ttft_p50_ratio_vs_vllm_nixl", "vllm_nixl_kv_bytes", "vllm_nixl_recomputes", "planner_max_error",
             "exposed_transfer_ms", "push_vs_raw_tcp_same_streams", "shm_vs_memcpy")
CALIBRATED = ("plain_default", "plain_bind01", "ours_tcp")
"""Deployments the planner is calibrated on and compared with (plain: the baseline binding only)."""


@dataclass
class Plan:
    num_requests: int = 30
    rounds: int = 3
    deployments: list[str] = field(default_factory=lambda: ["plain_default", "plain_bind01", "vllm_nixl", "ours_tcp",
                                                            "ours_shm", "ours_nano"])
    saturation: list[str] = field(default_factory=lambda: ["plain_default", "plain_bind01", "vllm_nixl", "ours_tcp",
                                                           "ours_traced", "ours_pd_only", "ours_colocate_only", "ours_mixed",
                                                           "ours_mixed_both"])
    """Also run at the saturation rate when chosen (ours_traced, ours_pd_only, ours_colocate_only, ours_mixed*: only when --deployments
    names them)."""
    bisect: list[str] = field(default_factory=lambda: ["plain", "vllm_nixl", "ours_tcp"])
    """'plain' = the better plain binding."""
    bisect_steps: int = 3
    probe_cap_s: float = 150.0
    """A bisection probe replays about this many seconds of arrivals (serve_bisect.py)."""
    probe_min_requests: int = 8
    probe_replays: int = 1
    """Replays of each bisection probe (its goodput: their median; the planner compares its prediction
    with their median): one replay of a 20-request window repeats within 0.21-0.31 (serve_fold.py)."""
    bisect_hi: float | None = None
    """Top of the rate search (default: `saturation_rate`)."""
    once: list[str] = field(default_factory=list)
    """Deployments measured in the first round only (e.g. the plain binding that is not the baseline)."""
    rate: float = HEADLINE_RATE
    saturation_rate: float = SATURATION_RATE
    predict: bool = True


QUICK = Plan(rounds=1, deployments=["plain_default", "plain_bind01", "ours_tcp"], saturation=[], bisect=[],
             predict=False)


# ---------------------------------------------------------------- trace
def load_trace(name: str, num: int, max_model_len: int, max_output: int | None, trace_dir: Path) -> dict:
    """The window every deployment replays: `num` requests, capped to the model. `synthetic` needs no file
    (the planner's conversation shape, Poisson arrivals; for tests)."""
    if name == "synthetic":
        full, start, source = synthetic_trace("conversation", rps=1.0, num_requests=num, seed=0), 0, "synthetic"
    else:
        path = Path(name) if Path(name).exists() else trace_dir / TRACE_FILES.get(name, name)
        if not path.exists():
            raise SystemExit(f"serve_bench: no trace at {path}: see benchmarks/data/README.md (AzurePublicDataset, "
                             "CC-BY 4.0), put the CSVs in --trace-dir or $VLLM_DISAGG_TRACE_DIR")
        full, source = load_azure_csv(path), str(path)
        start = representative_window(full, num)
    window = cap_lengths(trace_window(full, start, num), max_model_len, max_output)
    return {"source": source, "start": start, "requests": window, "stats": describe(window),
            "trace_stats": describe(full) if name != "synthetic" else None,
            "num_capped": sum(a.num_prompt_tokens != b.num_prompt_tokens or a.num_output_tokens != b.num_output_tokens
                              for a, b in zip(trace_window(full, start, num), window))}


KINDS = ("headline", "saturation", "bisect")
IDS_PER_RUN = 10**5
MAX_PROBE_REPLAYS = 5
"""A probe's replays split its run's ids: 20,000 each, 320k prompt tokens (16 per id)."""


def first_id(round_idx: int, kind: str, rate: float, replay: int = 0) -> int:
    """Where a run's prompt ids start: every (round, kind, rate, replay) gets prompts of its own, so that no
    server sees a prompt twice (vLLM's prefix cache would serve it: a replayed window's TTFT fell from 12.5 s
    to 0.4 s), while the deployments of one round replay the very same prompts (paired runs)."""
    if not 0 <= replay < MAX_PROBE_REPLAYS:
        raise ValueError(f"replay {replay} outside 0..{MAX_PROBE_REPLAYS - 1}")
    base = (((round_idx + 2) * len(KINDS) + KINDS.index(kind)) * 10**5 + round(rate * 10**4)) * IDS_PER_RUN
    return base + replay * (IDS_PER_RUN // MAX_PROBE_REPLAYS)


def write_trace(window: list[TraceRequest], rate: float, out_dir: Path, start_id: int = 0) -> Path:
    lines = timed_trace_lines(rescale_rate(window, rate), first_id=start_id)
    if json.loads(lines[-1])["hash_ids"][-1] >= start_id + IDS_PER_RUN:
        raise ValueError(f"the window needs more than {IDS_PER_RUN} prompt chunk ids")
    path = out_dir / f"trace_{start_id}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------- runs
class Bench:
    def __init__(self, plan: Plan, args: argparse.Namespace, work: Path, trace: dict):
        self.plan, self.args, self.work, self.trace = plan, args, work, trace
        self.runs: list[dict] = []  # every measured run: deployment, rate, round, metrics
        self.profiles: dict[str, dict] = {}  # planner profiles calibrated on the running deployments
        self.after_phase = lambda: None  # called after every deployment phase (checkpoint)
        self.starts: dict[str, list] = {}
        self.max_rates: dict[str, dict] = {}  # the rate search's brackets so far (serve_bisect.py)

    def run_once(self, running, rate: float, round_idx: int, kind: str, window: list | None = None,
                 replay: int = 0) -> dict:
        window = window or self.trace["requests"]
        path = write_trace(window, rate, self.work, first_id(round_idx, kind, rate, replay))
        name = f"{running.deployment.name}_r{round_idx}_{kind}_{rate:g}" + (f"_x{replay}" if replay else "")
        timeout = len(window) / rate + 900
        log(f"{name}: replaying {len(window)} requests at {rate:g} req/s")
        row = measure(running, self.args.model_dir, path, len(window), self.work, name, timeout)
        row.update(deployment=running.deployment.name, rate=rate, round=round_idx, kind=kind, window_size=len(window),
                   replay=replay)
        if row["kv"] is not None and not row["kv"]["verified"]:
            log(f"{name}: KV NOT VERIFIED: {row['kv']}")
        log(f"{name}: goodput {row['goodput'][HEADLINE_SLO.key]} ttft p50 {row['ttft_p50_ms']} "
            f"tbt p99 {row['tbt_p99_ms']} tok/s {row['output_tok_s']}")
        self.runs.append(row)
        return row

    def deployment(self, name: str, round_idx: int, rates: list[tuple[str, float]]) -> None:
        dep = DEPLOYMENTS[name]
        log_dir = self.work / "logs" / f"{name}_r{round_idx}"
        with heavy_lock(self.args.lock), started(dep, self.args.model_dir, self.args.max_model_len,
                                                 log_dir) as running:
            log(f"{name}: ready in {running.start_s:.0f} s")
            self.starts.setdefault(name, []).append({"start_s": running.start_s, "placement": running.placement})
            warm_up(running, min(600, self.args.max_model_len // 2))
            self.calibrate(running)
            for kind, rate in rates:
                self.run_once(running, rate, round_idx, kind)
            if name in self.plan.bisect and round_idx == self.last_round(name):
                search(self, name, name, running)  # its rate search reuses this start (serve_bisect.py)

    def last_round(self, name: str) -> int:
        return 0 if name in self.plan.once else self.plan.rounds - 1

    def rounds(self) -> None:
        deps = self.plan.deployments
        for r in range(self.plan.rounds):
            order = deps[r % len(deps):] + deps[:r % len(deps)]  # rotate: no deployment always runs first
            for name in (d for d in order if r == 0 or d not in self.plan.once):
                rates = [("headline", self.plan.rate)]
                if name in self.plan.saturation:
                    rates.append(("saturation", self.plan.saturation_rate))
                self.deployment(name, r, rates)
                self.after_phase()

    def calibrate(self, running) -> None:
        """The planner's profile of a deployment it is compared on, once per run (serve_predict.py)."""
        name = running.deployment.name
        if self.plan.predict and name in CALIBRATED and name not in self.profiles:
            from serve_predict import calibrate

            log(f"{name}: calibrating the planner")
            self.profiles[name] = calibrate(running, self.args.max_model_len)


@contextlib.contextmanager
def heavy_lock(paths: list[Path] | None):
    """On a shared box: hold these flock files for one deployment's phase, start to stop (a few minutes),
    and let others run between phases; the load average around every run is recorded either way. With
    both of the box's heavy slots (/work/coord/heavy --exclusive's files) nobody else's heavy job runs."""
    if not paths:
        yield
        return
    want = paths[0].with_name("vd-exclusive.want") if len(paths) > 1 else None
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if want is not None:
            want.touch()  # new jobs of others wait while this is pending (the heavy wrapper's rule)
        for path in paths:
            f = stack.enter_context(open(path, "a"))
            fcntl.flock(f, fcntl.LOCK_EX)
            stack.callback(fcntl.flock, f, fcntl.LOCK_UN)
        if want is not None:
            want.unlink(missing_ok=True)
        if time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f} s for {', '.join(map(str, paths))}")
        yield


# ------------------------------------------------------------------ main
def listed(parser: argparse.ArgumentParser, flag: str, value: str, allowed) -> list[str]:
    """A comma-separated flag's names, or one clear line naming the unknown ones: a typo must not
    silently drop a deployment from a two-hour run."""
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)} (known here: {', '.join(allowed)})")
    return names


def bisect_names(deployments: list[str]) -> list[str]:
    """What --bisect may name: a measured deployment, or 'plain' (the better plain binding) when one
    is measured."""
    return (["plain"] if any(d.startswith("plain") for d in deployments) else []) + list(deployments)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="<= 15 min: plain + ours_tcp, one rate, one round")
    parser.add_argument("--trace", default="conv", help="conv | code | synthetic | a CSV path")
    parser.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACE_DIR)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--rate", type=float, default=None, help=f"headline rate, req/s (default {HEADLINE_RATE})")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--deployments", default=None, help="comma-separated subset of " + ",".join(DEPLOYMENTS))
    parser.add_argument("--once", default=None, help="comma-separated deployments measured in round 0 only")
    parser.add_argument("--no-bisect", action="store_true")
    parser.add_argument("--bisect", default=None,
                        help="comma-separated deployments whose rate is searched ('plain' = the better plain "
                             "binding; default plain,vllm_nixl,ours_tcp where measured)")
    parser.add_argument("--bisect-only", action="store_true",
                        help="only the rate search (and the planner's prediction at its rates) of --deployments; "
                             "writes results/serve_bench_bisect.json, which serve_import.py reads its keys from")
    parser.add_argument("--bisect-hi", type=float, default=None,
                        help=f"top of the rate search, req/s (default the saturation rate, {SATURATION_RATE})")
    parser.add_argument("--no-saturation", action="store_true")
    parser.add_argument("--probe-replays", type=int, default=1,
                        help="replays of each bisection probe, on fresh prompts (median goodput; default 1)")
    parser.add_argument("--no-predict", action="store_true", help="skip the planner's calibration and prediction")
    parser.add_argument("--model", default="smollm2-135m", help="embedded model name or a local directory")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-output-tokens", type=int, default=512)
    parser.add_argument("--lock", type=Path, action="append", default=None,
                        help="shared box: hold this flock file around each deployment's phase; repeat for several "
                             "(this box: --lock /tmp/vd-heavy.lock --lock /tmp/vd-heavy2.lock = both heavy slots)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default results/serve_bench{_quick}.json)")
    args = parser.parse_args()
    # a `timeout` (SIGTERM) unwinds like ^C: every started deployment is stopped, the partial JSON stays
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = QUICK if args.quick else Plan()
    if args.num_requests:
        plan.num_requests = args.num_requests
    if args.rate:
        plan.rate = args.rate
    if args.rounds:
        plan.rounds = args.rounds
    if args.deployments:
        chosen = listed(parser, "--deployments", args.deployments, DEPLOYMENTS)
        plan.deployments = chosen
        plan.saturation = [d for d in plan.saturation if d in chosen]
        plan.bisect = [d for d in plan.bisect if d in bisect_names(chosen)]
    if args.once:
        plan.once = listed(parser, "--once", args.once, DEPLOYMENTS)
        plan.deployments += [d for d in plan.once if d not in plan.deployments]
    if args.bisect_only:
        plan.rounds = 0
        plan.saturation = []
    if args.bisect:
        plan.bisect = listed(parser, "--bisect", args.bisect, bisect_names(plan.deployments))
    if args.no_bisect:
        plan.bisect = []
    if args.no_saturation:
        plan.saturation = []
    plan.bisect_hi = args.bisect_hi
    if not 1 <= args.probe_replays <= MAX_PROBE_REPLAYS:
        parser.error(f"--probe-replays: 1 to {MAX_PROBE_REPLAYS}, got {args.probe_replays}")
    plan.probe_replays = args.probe_replays
    if args.no_predict:
        plan.predict = False
    from vllm_disagg.models import launch_model

    args.model_dir = launch_model(args.model)
    return run(plan, args)


def result_of(bench: Bench, args: argparse.Namespace, trace: dict, t0: float, plain: str | None, max_rates: dict,
              prediction: dict | None) -> dict:
    keys = summary(bench, plain, max_rates, prediction, args.quick)
    return {**keys, "plan": asdict(bench.plan), "wall_s": time.monotonic() - t0,
            "window": {"trace": args.trace, "max_model_len": args.max_model_len,
                       "max_output_tokens": args.max_output_tokens, "dtype": engine_dtype()},
            "trace": {k: v for k, v in trace.items() if k != "requests"}, "max_rates": max_rates,
            "medians": medians(bench.runs), "starts": bench.starts, "prediction": prediction, "runs": bench.runs}


def run(plan: Plan, args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    log(f"work dir (client results, instance logs) {work}")
    trace = load_trace(args.trace, plan.num_requests, args.max_model_len, args.max_output_tokens, args.trace_dir)
    log(f"trace {trace['source']} window [{trace['start']}, +{plan.num_requests}): {trace['stats']}")
    bench = Bench(plan, args, work, trace)
    t0 = time.monotonic()
    out = args.out or RESULTS / f"serve_bench{'_quick' if args.quick else '_bisect' if args.bisect_only else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.json")  # a run cut short keeps what it measured
    bench.after_phase = lambda: partial.write_text(json.dumps(
        result_of(bench, args, trace, t0, pick_plain(medians(bench.runs)), bench.max_rates, None) | {"partial": True}, indent=1))
    bench.rounds()
    plain = pick_plain(medians(bench.runs)) or next((d for d in plan.deployments if d.startswith("plain")), None)
    max_rates = bisect(bench, plain, heavy_lock) if plan.bisect else {}
    prediction = None
    if plan.predict:
        from serve_predict import predict

        prediction = predict(bench.runs, trace["requests"], bench.profiles, args.model_dir, plain)
    result = result_of(bench, args, trace, t0, plain, max_rates, prediction)
    result = result if args.bisect_only else import_keys(result, out.parent)
    out.write_text(json.dumps(result, indent=1))
    partial.unlink(missing_ok=True)
    from serve_plot import plot

    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in (*GOAL_KEYS, "tracing_overhead_ratio", "quick", "plain_baseline", "rate_in_goal_band",
                                              "nixl_verified", "ours_verified", "load_first", "load_last")}))
    if result["nixl_verified"] is False or result["ours_verified"] is False:
        log("FAILED: a P/D deployment did not move its KV (see runs[].kv)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
