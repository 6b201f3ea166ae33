# SPDX-License-Identifier: Apache-2.0
"""What every GPU-kit step shares: the result record, the time budget, device facts and timing.

A step fills one `StepResult` and writes it as one JSON file. Each measurement inside a step is a
named check with a status: `ok`, `failed` (with the error), `unsupported on this runtime` (the
runtime refused a feature, e.g. green contexts or CUDA IPC under gVisor: reported, not a failure)
or `skipped` (no GPU, or the step's time budget ran out). Nothing here is ever marked measured on
a GPU unless it ran on one (`measured_on_gpu`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, FAILED, UNSUPPORTED, SKIPPED = "ok", "failed", "unsupported on this runtime", "skipped"
STATUSES = (OK, FAILED, UNSUPPORTED, SKIPPED)
REPO = Path(__file__).resolve().parents[2]


class Unsupported(RuntimeError):
    """The runtime refused a feature (driver, sandbox): reported with its error, not as a failure."""


class Budget:
    """A step's wall-clock budget: later measurements are skipped, not overrun, when it runs out."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.t0 = time.monotonic()

    @property
    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def allows(self, seconds: float) -> bool:
        return self.left >= seconds


@dataclass
class StepResult:
    step: str
    title: str
    device: str
    """"cuda" on the lent machine; "cpu" for the CPU twin (shape and logic, never figures)."""
    checks: dict[str, dict] = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    @property
    def measured_on_gpu(self) -> bool:
        return self.device == "cuda"

    def run(self, name: str, fn: Callable[[], dict], budget: Budget | None = None, need_s: float = 0.0) -> dict:
        """Run one check; its dict of figures lands under `checks[name]` with a status."""
        if budget is not None and not budget.allows(need_s):
            return self.skip(name, f"step time budget: {budget.left:.0f} s left, needs ~{need_s:.0f} s")
        t0 = time.monotonic()
        try:
            out = {"status": OK, **(fn() or {})}
        except Unsupported as err:
            out = {"status": UNSUPPORTED, "error": str(err)}
        except Exception as err:  # noqa: BLE001 - one check failing must not lose the others
            out = {"status": FAILED, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc(limit=8)}
        out["seconds"] = round(time.monotonic() - t0, 3)
        self.checks[name] = out
        return out

    def skip(self, name: str, reason: str) -> dict:
        self.checks[name] = {"status": SKIPPED, "reason": reason}
        return self.checks[name]

    def to_dict(self) -> dict:
        failed = [n for n, c in self.checks.items() if c["status"] == FAILED]
        return {
            "step": self.step, "title": self.title, "device": self.device,
            "measured_on_gpu": self.measured_on_gpu, "ok": not failed, "failed_checks": failed,
            "elapsed_s": round(time.monotonic() - self.t0, 2),
            "environment": self.environment, "checks": self.checks,
        }

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        suffix = "" if self.measured_on_gpu else f"_{self.device}_twin"
        path = out_dir / f"gpu_check_{self.step}{suffix}.json"
        path.write_text(json.dumps(self.to_dict(), indent=1, default=_jsonable) + "\n")
        return path


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def environment(device: str) -> dict:
    """Facts about the machine a step ran on (GPU name, SMs, driver, runtime kernel, load)."""
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release(),
           "hostname_is_gvisor": platform.release().startswith("4.4.0"), "load_avg": _load_avg()}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                   cuda=torch.version.cuda, driver=_driver_version())
    return env


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_ready() -> str | None:
    """None when a CUDA device is usable here, else why not (the reason a GPU check is skipped)."""
    try:
        import torch
    except ImportError as err:
        return f"torch not importable: {err}"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def run_pytest(test: str, *args: str, timeout_s: float = 300) -> dict:
    """Run a test file of the repo's suite (its GPU cases run where CUDA is present); raise on failure."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test, *args],
                         capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO)
    lines = out.stdout.strip().splitlines()
    tail = lines[-1] if lines else out.stderr[-300:]
    if out.returncode:
        raise RuntimeError(f"pytest {test}: {tail}\n{out.stdout[-2000:]}")
    if " passed" not in tail:
        raise RuntimeError(f"pytest {test} ran no test: {tail}")
    return {"tests": test, "summary": tail}


def time_cuda(fn: Callable[[], Any], iters: int = 20, warmup: int = 3, stream: Any = None) -> dict:
    """Median and p90 milliseconds of `fn` timed with CUDA events on `stream` (default: current)."""
    import torch

    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return summary_ms(times)


def time_host(fn: Callable[[], Any], iters: int = 20, warmup: int = 3, sync: Callable[[], Any] | None = None) -> dict:
    """Median and p90 milliseconds of `fn` by the host clock (`sync` after each call, e.g. cuda sync)."""
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return summary_ms(times)


def summary_ms(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(ordered), 4),
            "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4),
            "min_ms": round(ordered[0], 4), "n": len(ordered)}


def rel_error(out: Any, ref: Any) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (METHOD.md's check); NaN anywhere fails it."""
    import torch

    out64, ref64 = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item() or 1.0
    return (out64 - ref64).norm().item() / denom
