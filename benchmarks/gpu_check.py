# SPDX-License-Identifier: Apache-2.0
"""The GPU campaign kit: one device call per step, one JSON per step (docs/gpu.md).

    a  csrc seqno kernel: nvcc build for the device's arch, poll-to-observe latency
    b  NanoFlow on real SMs: SM shares, GEMM-vs-GEMV interference, planner per op, executor overlap
    c  Lamina on a GPU: LSE-merge exactness, head/request partitions, model -> server round trip
    d  layer-wise KV push from GPU memory between two processes (CUDA IPC, NIXL)

On the lent machine: `bash benchmarks/gpu/run_step.sh a` (= `make gpu-check STEP=a`): installs the
carried wheels, runs the step, writes `$OUT/gpu_check_a.json`. Here: `--dry-run` (`make gpu-check
DRY=1`, run by CI) plans the steps, checks the wheel set, the size of what a call carries, that every
module a step imports loads with the device's packages (no vLLM), and skips each GPU step with its
reason. `--cpu-twin` runs each step's CPU twin (logic and JSON shape, never figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))  # the step modules; spawned children re-import this file first

from common import REPO, Budget, cuda_ready, environment  # noqa: E402

STEPS = {  # step -> (module, budget in seconds on a warm machine, modules it imports)
    "a": ("seqno", 120, ("vllm_disagg.transport.rdma.gpu", "vllm_disagg.testing")),
    "b": ("nanoflow_gpu", 240, ("sm_share", "decoder", "vllm_disagg.nanoflow.units", "vllm_disagg.nanoflow.executor",
                                "vllm_disagg.nanoflow.graph", "vllm_disagg.planner.cli")),
    "c": ("lamina_gpu", 180, ("vllm_disagg.attention.server", "vllm_disagg.attention.client",
                              "vllm_disagg.attention.cli", "vllm_disagg.attention.kernels")),
    "d": ("kv_push_gpu", 150, ("vllm_disagg.kv.layer_events", "vllm_disagg.transport.nixl",
                               "vllm_disagg.transport.nixl.kv_tx", "vllm_disagg.transport.nixl.kv_rx")),
}
CALL_LIMIT_S, SESSION_LIMIT_S = 480, 900  # per step (8 min) and all four (15 min), warm machine
DEVICE_LACKS = ("vllm", "fastapi", "uvicorn", "gguf", "flashinfer", "ray", "pyverbs", "mscclpp",
                "kubernetes_validate", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "nixl",
                "nixl_cu13", "nixl_cu12", "opentelemetry")
"""Top-level modules of the project's dependencies that the lent machine's image does not have."""
DIST_MODULES = {"opentelemetry_api": "opentelemetry"}
"""Carried distributions whose top-level module has another name."""


def device_call(step: str) -> dict:
    """The `run` tool invocation for one step (docs/gpu.md lists the same)."""
    budget = STEPS[step][1]
    return {"command": f"bash benchmarks/gpu/run_step.sh {step}", "carry": [".whl"],
            "timeout_s": min(600, budget + 90), "kind": "leave it out (an H100 or, when none is free, an H200)"}


def run_steps(steps: list[str], device: str, out_dir: Path) -> int:
    import importlib

    rows, failed = [], False
    env = environment(device)
    for step in steps:
        module, budget_s, _ = STEPS[step]
        t0 = time.monotonic()
        result = importlib.import_module(module).run_step(device, Budget(budget_s))
        result.environment = env
        path = result.write(out_dir)
        failed |= not result.to_dict()["ok"]
        for name, check in result.checks.items():
            rows.append((step, name, check["status"], _headline(check)))
        print(f"step {step}: {time.monotonic() - t0:.1f} s -> {path}", flush=True)
    print(f"\n{'step':4} {'check':34} {'status':28} headline")
    for step, name, status, headline in rows:
        print(f"{step:4} {name:34} {status:28} {headline}")
    return 1 if failed else 0


def _headline(check: dict) -> str:
    if check["status"] != "ok":
        return (check.get("error") or check.get("reason") or "")[:90]
    keys = [k for k in check if k not in ("status", "seconds", "traceback")]
    return json.dumps({k: check[k] for k in keys[:3]}, default=str)[:90]


# ------------------------------------------------------------------ dry run
def dry_run(steps: list[str], out_dir: Path | None) -> int:
    import wheels

    report: dict = {"steps": {}, "problems": []}
    why_not = cuda_ready()
    total = 0
    for step in steps:
        module, budget_s, _ = STEPS[step]
        total += budget_s
        report["steps"][step] = {"module": f"benchmarks/gpu/{module}.py", "budget_s": budget_s,
                                 "device_call": device_call(step),
                                 "here": f"skipped: {why_not}" if why_not else "a CUDA device is present: run it"}
        if budget_s > CALL_LIMIT_S:
            report["problems"].append(f"step {step}: budget {budget_s} s over the {CALL_LIMIT_S} s a call may take")
    if total > SESSION_LIMIT_S:
        report["problems"].append(f"steps take up to {total} s together, over {SESSION_LIMIT_S} s")
    report["wheels"] = wheels.check()
    report["problems"] += report["wheels"]["problems"]
    report["travel"] = wheels.travel_bytes()
    if not report["travel"]["fits"]:
        report["problems"].append(f"a device call would carry {report['travel']['total_bytes']} bytes, over 64 MiB")
    report["imports"] = import_check(steps)
    report["problems"] += [f"import {m}: {e}" for m, e in report["imports"].items() if e]
    _print_plan(report, total)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_check_dry.json").write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["problems"] else 0


def import_check(steps: list[str]) -> dict[str, str]:
    """Import every step module (and the `vllm-disagg plan` CLI) in a fresh interpreter where the
    packages the device lacks, minus the carried wheels, cannot be imported: module -> error or ""."""
    import wheels

    carried = {DIST_MODULES.get(wheels._norm(n), wheels._norm(n)) for n, _ in wheels.specs()}
    blocked = sorted(set(DEVICE_LACKS) - carried)
    modules = [m for s in steps for m in (STEPS[s][0], *STEPS[s][2])]
    script = _IMPORT_PROBE.format(blocked=blocked, modules=modules)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE / "gpu"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                         cwd=REPO)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"<probe>": f"exit {out.returncode}: {out.stderr[-1500:]}"}


_IMPORT_PROBE = r"""
import importlib, importlib.abc, json, runpy, sys, io, contextlib
BLOCKED = set({blocked})
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not on the lent machine")
sys.meta_path.insert(0, Block())
errors = {{}}
for m in {modules}:
    try:
        importlib.import_module(m); errors[m] = ""
    except Exception as e:
        errors[m] = f"{{type(e).__name__}}: {{e}}"
sys.argv = ["vllm-disagg", "plan", "nanoflow", "--gpu", "h100", "--num-gpus", "1", "--json"]
try:
    with contextlib.redirect_stdout(io.StringIO()):
        runpy.run_module("vllm_disagg.cli.main", run_name="__main__")
    errors["vllm-disagg plan nanoflow"] = ""
except SystemExit as e:
    errors["vllm-disagg plan nanoflow"] = "" if e.code in (0, None) else f"exit {{e.code}}"
except Exception as e:
    errors["vllm-disagg plan nanoflow"] = f"{{type(e).__name__}}: {{e}}"
print(json.dumps(errors))
"""


def _print_plan(report: dict, total: int) -> None:
    print(f"GPU kit plan: {len(report['steps'])} steps, up to {total} s of device time together "
          f"(limits: {CALL_LIMIT_S} s a step, {SESSION_LIMIT_S} s in all)")
    for step, s in report["steps"].items():
        call = s["device_call"]
        print(f"  {step}: {s['module']} budget {s['budget_s']} s; run: command={call['command']!r} "
              f"carry={call['carry']} timeout_s={call['timeout_s']}; here: {s['here']}")
    w, t = report["wheels"], report["travel"]
    built = f"built, {w['bytes'] / 2**20:.1f} MiB" if w["built"] else w["note"]
    print(f"wheel set: {built}; a call carries {t['total_bytes'] / 2**20:.1f} MiB of 64 MiB "
          f"(tree {t['tree_bytes'] / 2**20:.1f} MiB, margin {t['margin_mib']} MiB)")
    bad = {m: e for m, e in report["imports"].items() if e}
    print(f"imports without vLLM: {len(report['imports']) - len(bad)}/{len(report['imports'])} load" +
          "".join(f"\n  {m}: {e}" for m, e in bad.items()))
    print("dry run: " + ("OK" if not report["problems"] else "PROBLEMS:\n  " + "\n  ".join(report["problems"])))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", default="all", help="a, b, c, d, or all (default)")
    ap.add_argument("--dry-run", action="store_true", help="plan and check here; run nothing on a GPU")
    ap.add_argument("--cpu-twin", action="store_true", help="run each step's CPU twin (no figures)")
    ap.add_argument("--out", default=None, help="result folder (default $OUT, else benchmarks/results/gpu)")
    args = ap.parse_args(argv)
    steps = list(STEPS) if args.step == "all" else [s.strip() for s in args.step.split(",")]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; pick from {list(STEPS)} or all")
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "results" / "gpu")
    if args.dry_run:
        return dry_run(steps, Path(args.out) if args.out else None)
    if args.cpu_twin:
        return run_steps(steps, "cpu", out)
    why_not = cuda_ready()
    if why_not:
        print(f"no GPU here ({why_not}): use --dry-run or --cpu-twin", file=sys.stderr)
        return 2
    return run_steps(steps, "cuda", out)


if __name__ == "__main__":
    sys.exit(main())
