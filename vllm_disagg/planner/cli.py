# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg plan {nanoflow,lamina,splitwise}`: the planner on the command line.

Each command prints a readable table, or JSON with `--json`; `--plot out.png`
draws the figure of its paper (NanoFlow Table 2 bars, Lamina Fig. 4,
Splitwise Fig. 12).
"""

from __future__ import annotations

from vllm_disagg.planner import lamina, nanoflow, report
from vllm_disagg.planner.catalog import get_hardware
from vllm_disagg.planner.cli_common import add_common_args, guard, profile_arg, resolve_model
from vllm_disagg.planner.cli_splitwise import add_splitwise_parser


def add_parser(subparsers) -> None:
    plan = subparsers.add_parser("plan", help="size a deployment with the papers' models",
                                 description=__doc__.splitlines()[0])
    sub = plan.add_subparsers(dest="plan_command", metavar="PAPER")
    _nanoflow_parser(sub)
    _lamina_parser(sub)
    add_splitwise_parser(sub, add_common_args, guard)
    plan.set_defaults(func=lambda args: (plan.print_help(), 2)[1])


# ------------------------------------------------------------------ nanoflow
def _nanoflow_parser(sub) -> None:
    p = sub.add_parser("nanoflow", help="NanoFlow cost model (§3, Table 2, Eq. 1-9)")
    add_common_args(p, "llama-2-70b")
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--num-gpus", type=int, default=8)
    p.add_argument("--dense-batch", type=int, default=2048)
    p.add_argument("--prompt", type=float, default=512, help="average prompt tokens p")
    p.add_argument("--output", type=float, default=1024, help="average output tokens d")
    p.add_argument("--tflops", type=float, help="achievable TFLOP/s per GPU (e.g. 260)")
    p.set_defaults(func=guard(run_nanoflow))


def nanoflow_summary(args) -> dict:
    model, gpu = resolve_model(args), get_hardware(args.gpu, tuple(args.catalog))
    wl = nanoflow.Workload(args.dense_batch, args.prompt, args.output)
    rows = nanoflow.op_costs(model, gpu, args.num_gpus, wl, args.tflops, profile_arg(args))
    est = nanoflow.iteration_estimate(rows, args.dense_batch)
    t_r = nanoflow.memory_compute_ratio(model, gpu, args.num_gpus, args.prompt, args.output, args.tflops)
    opt = nanoflow.optimal_throughput(model, gpu, args.num_gpus, args.tflops)
    return {
        "model": model.name, "gpu": gpu.name, "num_gpus": args.num_gpus,
        "workload": {"dense_batch": wl.dense_batch, "prompt": wl.prompt_len,
                     "output": wl.output_len, "num_requests": wl.num_requests},
        "ops": [r.to_dict() for r in rows],
        "totals_ms": {"t_compute": est.t_compute_ms, "t_mem": est.t_mem_ms,
                      "t_net": est.t_net_ms, "sequential": est.sequential_ms},
        "bound": est.bound, "t_r": t_r, "verdict_eq8": nanoflow.verdict(t_r),
        "max_requests_eq5": nanoflow.max_requests(model, gpu, args.num_gpus, args.prompt, args.output),
        "optimal_throughput_tok_s": opt, "optimal_per_gpu_tok_s": opt / args.num_gpus,
        "overlapped_throughput_tok_s": est.throughput_overlapped,
        "sequential_throughput_tok_s": est.throughput_sequential,
        "kv_offload_gib_s": nanoflow.kv_offload_bandwidth(model, opt) / 2 ** 30,
        "nano_batches": nanoflow.nano_batch_plan(args.dense_batch, args.num_gpus),
    }


def run_nanoflow(args) -> int:
    out = nanoflow_summary(args)
    if args.plot:
        report.plot_ops(out["ops"], args.plot, f"{out['model']} on {args.num_gpus}x{out['gpu']}")
    if args.json:
        print(report.dump_json(out))
        return 0
    cols = ["name", "gflop", "mem_gb", "net_gb", "t_compute_ms", "t_mem_ms", "t_net_ms",
            "measured_ms", "bound"]
    print(report.table(out["ops"], cols, f"NanoFlow cost model: {out['model']} on "
                                          f"{args.num_gpus}x{out['gpu']}, B_dense "
                                          f"{args.dense_batch}, p={args.prompt:g}, d={args.output:g}"))
    t = out["totals_ms"]
    print()
    print(report.key_values({
        "T_compute / T_mem / T_net (ms)": f"{t['t_compute']:.2f} / {t['t_mem']:.2f} / "
                                          f"{t['t_net']:.2f}",
        "iteration bound": out["bound"],
        "T_R (Eq. 8)": f"{out['t_r']:.3f} -> {out['verdict_eq8']}",
        "optimal throughput (Eq. 9)": f"{out['optimal_throughput_tok_s']:,.0f} tok/s "
                                      f"({out['optimal_per_gpu_tok_s']:,.0f} /GPU)",
        "sequential (no overlap)": f"{out['sequential_throughput_tok_s']:,.0f} tok/s",
        "KV offload bandwidth": f"{out['kv_offload_gib_s']:.2f} GiB/s",
        "nano-batches": out["nano_batches"],
    }))
    return 0


# -------------------------------------------------------------------- lamina
def _lamina_parser(sub) -> None:
    p = sub.add_parser("lamina", help="Lamina attention offloading (§2-3, Tables 1, 3, 5)")
    add_common_args(p, "llama3-70b")
    p.add_argument("--compute-gpu", default="h100")
    p.add_argument("--memory-gpu", default="h20")
    p.add_argument("--dop", action="append", default=[],
                   help="a,b: a compute and b memory devices; repeat, or give a,b,c,d for "
                        "several pairs (default: a sweep)")
    p.add_argument("--batch", type=int, default=300)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--alpha", type=float, default=0.2)
    p.set_defaults(func=guard(run_lamina))


def parse_dops(values: list[str]) -> list[tuple[int, int]]:
    nums = [int(x) for v in values for x in v.replace("x", ",").split(",") if x.strip()]
    if len(nums) % 2:
        raise SystemExit(f"--dop wants pairs a,b; got {values}")
    return [(nums[i], nums[i + 1]) for i in range(0, len(nums), 2)] or [
        (1, 2), (2, 2), (2, 4), (4, 4), (4, 8)]


def lamina_summary(args) -> dict:
    model, cats = resolve_model(args), tuple(args.catalog)
    comp, mem = get_hardware(args.compute_gpu, cats), get_hardware(args.memory_gpu, cats)
    prof = profile_arg(args)
    rows, curves = [], {}
    for dop in parse_dops(args.dop):
        est = lamina.estimate_dop(model, comp, mem, dop, args.context, args.batch, args.alpha,
                              profile=prof)
        num_baseline_devices = lamina.baseline_devices(comp, est.cost_per_hour)
        base = lamina.estimate_baseline(model, comp, num_baseline_devices, args.context, args.batch)
        xs = list(range(1, args.batch + 1))
        ys = [lamina.min_bandwidth(model, comp, mem, dop, b, args.context, args.alpha,
                               profile=prof).per_compute_device / 1e9 for b in xs]
        curves[est.label] = (xs, ys)
        rows.append({**est.to_dict(), "max_bw_up_to_batch_gbs": max(ys),
                     "baseline": base.to_dict(),
                     "speedup_vs_baseline": est.throughput_tok_s / base.throughput_tok_s})
    return {"model": model.name, "compute": comp.name, "memory": mem.name,
            "context": args.context, "batch": args.batch, "alpha": args.alpha,
            "kv_bytes_per_token": lamina.kv_bytes_per_token(model),
            "bytes_per_request_iteration": lamina.bytes_per_request_iteration(model),
            "requests_per_memory_device": lamina.requests_per_device(model, mem, args.context),
            "best_dop": max((r for r in rows if r["fits"]), key=lambda r: r["tok_per_dollar"],
                            default={}).get("label"),
            "dops": rows, "_curves": curves}


def run_lamina(args) -> int:
    out = lamina_summary(args)
    curves = out.pop("_curves")
    if args.plot:
        report.plot_bandwidth(curves, 30.0, args.plot,
                              f"{out['model']}: {out['compute']}+{out['memory']}, "
                              f"l={args.context}, alpha={args.alpha}")
    if args.json:
        print(report.dump_json(out))
        return 0
    flat = [{**r, "baseline_label": r["baseline"]["label"],
             "baseline_cost": r["baseline"]["cost_per_hour"],
             "baseline_tok_s": r["baseline"]["throughput_tok_s"]} for r in out["dops"]]
    cols = ["label", "cost_per_hour", "max_batch", "batch", "tbt_ms", "throughput_tok_s",
            "bandwidth_per_compute_gbs", "max_bw_up_to_batch_gbs", "baseline_label",
            "baseline_cost", "baseline_tok_s", "speedup_vs_baseline"]
    print(report.table(flat, cols, f"Lamina: {out['model']} on {out['compute']} (model) + "
                                   f"{out['memory']} (attention), context {args.context}, "
                                   f"alpha {args.alpha}"))
    print()
    print(report.key_values({
        "KV bytes/token": out["kv_bytes_per_token"],
        "bytes/request/iteration": out["bytes_per_request_iteration"],
        f"requests per {out['memory']} at l={args.context}": out["requests_per_memory_device"],
        "best DOP (tokens per $)": out["best_dop"],
    }))
    return 0
