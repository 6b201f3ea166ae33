# SPDX-License-Identifier: Apache-2.0
"""What each serve_bench deployment burns while it serves nothing: CPU per process and its hottest thread.

On this 2-core box every core a deployment spins on is taken from the others' work and from the
client. Measured on the deployments exactly as serve_bench starts them (serve_deploy.py), after the
readiness request, with no load: the cores busy (CPU seconds per second) of each process, and of the
hottest thread, with its native stack when gdb is there (which library spins, not just that one does).

    python benchmarks/idle_cpu.py                      # vllm_nixl, ours_tcp, plain_default
    python benchmarks/idle_cpu.py --deployments vllm_nixl --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from serve_deploy import DEPLOYMENTS, process_trees, started  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SETTLE_S = 10.0
"""After ready: the readiness request and its transfer are over."""


def _cpu(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds of each thread of `proc`."""
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except psutil.Error:
        return {}


def _native_stack(tid: int) -> list[str]:
    """The thread's native frames (gdb attached to the thread id), or [] without gdb."""
    if not shutil.which("gdb"):
        return []
    out = subprocess.run(["gdb", "-p", str(tid), "-batch", "-ex", "bt"], capture_output=True, text=True,
                         timeout=120).stdout
    return [line.split(" in ", 1)[-1][:160] for line in out.splitlines() if line.startswith("#")][:6]


def measure(procs: list[psutil.Process], seconds: float) -> dict:
    """Cores busy per process over `seconds`, and the hottest thread of the deployment."""
    before = {p.pid: _cpu(p) for p in procs}
    start = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    per_process, hottest = {}, (0.0, None, None)
    for p in procs:
        after = _cpu(p)
        busy = {tid: (cpu - before[p.pid].get(tid, 0.0)) / wall for tid, cpu in after.items()}
        with_name = f"{p.name()}[{p.pid}]" if p.is_running() else str(p.pid)
        per_process[with_name] = round(sum(busy.values()), 3)
        for tid, value in busy.items():
            if value > hottest[0]:
                hottest = (value, tid, with_name)
    value, tid, owner = hottest
    return {"cores_busy": round(sum(per_process.values()), 3), "per_process": per_process,
            "hottest_thread": {"process": owner, "tid": tid, "cores_busy": round(value, 3),
                               "native_stack": _native_stack(tid) if tid and value > 0.5 else []}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployments", default="vllm_nixl,ours_tcp,plain_default")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--model", default=str(Path.home() / ".cache/vllm-disagg/models/smollm2-135m"))
    ap.add_argument("--out", type=Path, default=RESULTS / "idle_cpu.json")
    args = ap.parse_args()
    result = {"benchmark": "idle_cpu", "seconds": args.seconds, "num_cpus": os.cpu_count(),
              "loadavg_start": os.getloadavg(), "deployments": {}}
    with tempfile.TemporaryDirectory(prefix="idle-cpu-") as tmp:
        for name in args.deployments.split(","):
            with started(DEPLOYMENTS[name], args.model, 512, Path(tmp) / name) as run:
                time.sleep(SETTLE_S)
                result["deployments"][name] = measure(process_trees(run.procs), args.seconds)
                print(name, json.dumps(result["deployments"][name]), flush=True)
    result["loadavg_end"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
