# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg plan splitwise`: simulator, provisioning search and calibration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_disagg.planner import report
from vllm_disagg.planner.calibrate import validate
from vllm_disagg.planner.catalog import get_hardware
from vllm_disagg.planner.cli_common import resolve_model
from vllm_disagg.planner.profile import load_profile
from vllm_disagg.planner.provision import (
    Design,
    Evaluator,
    iso_count,
    search_min,
    search_throughput,
)
from vllm_disagg.planner.splitwise_sim import SimOptions
from vllm_disagg.planner.traces import (
    TRACE_STATS,
    TraceRequest,
    load_azure_csv,
    resample_poisson,
    rescale_rate,
    synthetic_trace,
)
from vllm_disagg.router.cli import add_queue_seconds_args, queue_seconds_from_args
from vllm_disagg.router.policy import SchedulerConfig


def add_splitwise_parser(sub, common, guard) -> None:
    p = sub.add_parser("splitwise", help="Splitwise cluster simulator and provisioning (§IV-V)")
    common(p, "llama-2-70b")
    p.add_argument("--design", default="HA", help="AA, HH, HA, HHcap, baseline-a100/h100")
    p.add_argument("--trace", default="coding",
                   help="coding, conversation (empirical Azure shapes), coding-lognormal, "
                        "conversation-lognormal, splitwise, lmsys, sharegpt, or an Azure CSV")
    p.add_argument("--target-rps", type=float, default=70.0)
    p.add_argument("--objective", choices=["cost", "power", "throughput"], default="cost")
    p.add_argument("--constraint", choices=["none", "iso-power", "iso-cost"], default="none")
    p.add_argument("--budget", default="40xdgx-h100",
                   help="reference fleet for iso-power/iso-cost, e.g. 40xdgx-h100")
    p.add_argument("--arrivals", choices=["trace", "poisson"], default="trace",
                   help="Azure CSV: keep its (rescaled) timestamps, or draw its sizes with "
                        "Poisson arrivals as SplitwiseSim does")
    p.add_argument("--duration", type=float, default=60.0, help="trace seconds to simulate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt", type=int, default=40)
    p.add_argument("--max-token", type=int, default=40)
    p.add_argument("--rps-range", default="5,200", help="lo,hi for throughput bisection")
    p.add_argument("--step", type=int, default=1, help="prompt-count step, throughput search")
    p.add_argument("--simulate", metavar="P,T", help="just simulate P prompt + T token machines")
    p.add_argument("--validate", action="store_true",
                   help="simulate 1P+1D with --profile and compare to its 'measured' block")
    p.add_argument("--layerwise-min-tokens", type=int, default=512)
    p.add_argument("--prefill-threshold", type=int, default=0,
                   help="pending prefill tokens before the mixed pool is used (0 = off, the router's default)")
    p.add_argument("--decode-threshold", type=int, default=0,
                   help="pending decode tokens before the mixed pool is used (0 = off, the router's default)")
    add_queue_seconds_args(p)
    p.set_defaults(func=guard(run_splitwise))


def _options(args) -> SimOptions:
    sched = SchedulerConfig(args.prefill_threshold or None, args.decode_threshold or None,
                            **queue_seconds_from_args(args))
    return SimOptions(sched, layerwise_min_tokens=args.layerwise_min_tokens)


def trace_source(args):
    """rps -> trace, from a synthetic kind or an Azure CSV rescaled to rps."""
    if args.trace in TRACE_STATS:
        return lambda rps: synthetic_trace(args.trace, rps, duration_s=args.duration,
                                           seed=args.seed)
    base = load_azure_csv(args.trace)
    if getattr(args, "arrivals", "trace") == "poisson":
        return lambda rps: resample_poisson(base, rps, args.duration, args.seed)
    return lambda rps: _window(rescale_rate(base, rps), args.duration)


def _window(trace: list[TraceRequest], duration: float) -> list[TraceRequest]:
    return [r for r in trace if r.arrival_s <= duration] or trace[:1]


def _budget(args, design: Design) -> tuple[str, float] | None:
    if args.constraint == "none":
        return None
    count, _, name = args.budget.partition("x")
    ref = get_hardware(name, tuple(args.catalog))
    kind = "power" if args.constraint == "iso-power" else "cost"
    unit = ref.power_w if kind == "power" else ref.price_per_hour
    return kind, int(count) * unit


def splitwise_summary(args) -> dict:
    model, design = resolve_model(args), Design.named(args.design, tuple(args.catalog))
    prof = load_profile(args.profile) if args.profile else None
    evaluate = Evaluator(model, design, _options(args), prof)
    traces = trace_source(args)
    if args.simulate:
        num_prompt, num_token = (int(x) for x in args.simulate.split(","))
        c = evaluate(num_prompt, num_token, traces(args.target_rps), args.target_rps)
        return {"design": design.name, "model": model.name, "simulated": c.to_dict()}
    budget = _budget(args, design)
    if args.objective == "throughput":
        if budget is None:
            raise SystemExit("--objective throughput needs --constraint iso-power or iso-cost")
        lo, hi = (float(x) for x in args.rps_range.split(","))
        res = search_throughput(evaluate, traces, budget[0], budget[1], (lo, hi), args.step)
    else:
        fits = _fits(budget)
        res = search_min(evaluate, traces, args.target_rps, args.objective, args.max_prompt,
                         args.max_token, fits)
    out = res.to_dict()
    out.update(model=model.name, trace=args.trace, target_rps=args.target_rps,
               constraint=args.constraint, budget=budget,
               iso_power_a100_for_budget=iso_count(get_hardware("dgx-h100"), 40,
                                                   get_hardware("dgx-a100")))
    return out


def _fits(budget):
    if budget is None:
        return lambda c: True
    kind, value = budget
    return lambda c: (c.power_w if kind == "power" else c.cost_per_hour) <= value + 1e-6


def validate_summary(args) -> dict:
    """Simulate the measured 1P+1D deployment and report prediction errors."""
    if not args.profile:
        raise SystemExit("--validate needs --profile measured.json")
    raw = json.loads(Path(args.profile).read_text())
    try:
        out = validate(resolve_model(args), raw, args.seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    out.pop("per_request")
    return out


def run_splitwise(args: argparse.Namespace) -> int:
    out = validate_summary(args) if args.validate else splitwise_summary(args)
    if args.plot and "evaluated" in out:
        title = f"Splitwise-{out['design']} {args.trace} @ {args.target_rps:g} RPS"
        if out["objective"] == "throughput":
            title = f"Splitwise-{out['design']} {args.trace}, {args.constraint} ({args.budget})"
            report.plot_throughput(out["evaluated"], args.plot, title)
        else:
            metric = "cost_per_hour" if out["objective"] == "cost" else "power_w"
            report.plot_design_space(out["evaluated"], out["best"], args.plot, title, metric)
    if args.json:
        print(report.dump_json(out))
        return 0
    _print(out)
    return 0


def _print(out: dict) -> None:
    if "predicted" in out:
        given = out.get("decode_given_first_tokens", {})
        print(report.key_values({**{f"predicted {k}": v for k, v in out["predicted"].items()},
                                 **{f"measured {k}": v for k, v in out["measured"].items()},
                                 **{f"error {k}": v for k, v in out["relative_error"].items()},
                                 **{f"error {k}, D given measured first tokens": v
                                    for k, v in given.get("relative_error", {}).items()}},
                                "Calibration: simulated 1P+1D vs measured"))
        return
    if "simulated" in out:
        c = out["simulated"]
        print(report.key_values({k: v for k, v in c.items() if k != "slo"},
                                f"Splitwise-{out['design']} simulation"))
        print(report.dump_json(c["slo"]))
        return
    cols = ["num_prompt", "num_token", "ok", "rps", "cost_per_hour", "power_w", "violations"]
    rows = sorted(out["evaluated"], key=lambda c: (c["num_prompt"], c["num_token"]))
    print(report.table(rows, cols, f"Splitwise-{out['design']} on {out['trace']}: "
                                   f"{out['objective']} search"))
    best = out["best"]
    print()
    if best is None:
        print("no configuration met all nine SLOs within the search bounds")
    else:
        print(f"optimum: {best['num_prompt']} prompt + {best['num_token']} token machines, "
              f"${best['cost_per_hour']:.2f}/h, {best['power_w'] / 1e3:.1f} kW, "
              f"{best['rps']:g} RPS")
