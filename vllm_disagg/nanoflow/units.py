# SPDX-License-Identifier: Apache-2.0
"""Execution units: bounded shares of the device that concurrent op streams run on.

One interface, two implementations:
- `CpuCoreGroup`: a thread group pinned to a core set (`os.sched_setaffinity` on the unit's own
  thread, whose OpenMP team inherits the mask) with its own torch intra-op thread count.
- `CudaSmStream`: a CUDA stream limited to a number of SMs through a CUDA green context
  (`cuda-python` driver API, CUDA >= 12.4). Fallback when green contexts are unavailable: a plain
  high-priority `torch.cuda.Stream` with no SM cap (logged once). Untested here (no GPU); tests are
  marked `gpu`.

More: README.md, "units.py".
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# CPUWorker replaces torch.set_num_threads with a warning stub; keep the real one.
set_num_threads = torch._C.set_num_threads


class ExecutionUnit(ABC):
    """A bounded share of the device; ops launched on it run in launch order."""

    def __init__(self, name: str, share: int) -> None:
        self.name = name
        self.share = share

    @abstractmethod
    def bind(self) -> None:
        """Called once, on the thread that will launch this unit's ops."""

    @abstractmethod
    def launch(self, fn: Callable[[], Any]) -> Any:
        """Run (CPU) or enqueue (GPU) `fn`; return a completion token."""

    def wait(self, token: Any) -> None:  # noqa: B027 - a no-op where launch is synchronous
        """Make later work on this unit wait for `token` (from any unit)."""

    def caller_token(self) -> Any:
        """A token for the work the calling thread has issued so far (GPU: an event on its stream)."""
        return None

    def join_caller(self, token: Any) -> None:  # noqa: B027 - nothing to join on CPU
        """Make the calling thread's later work wait for `token` from this unit."""

    def describe(self) -> dict:
        return {"name": self.name, "share": self.share, "kind": type(self).__name__}


class CpuCoreGroup(ExecutionUnit):
    """A thread pinned to `cores`, running torch ops with `len(cores)` intra-op threads."""

    def __init__(self, name: str, cores: tuple[int, ...], num_threads: int | None = None) -> None:
        if not cores:
            raise ValueError(f"unit {name!r}: empty core set")
        super().__init__(name, len(cores))
        self.cores = tuple(cores)
        self.num_threads = num_threads or len(self.cores)

    def bind(self) -> None:
        try:
            os.sched_setaffinity(0, self.cores)
        except (AttributeError, OSError) as err:  # non-Linux or cores not allowed
            logger.warning("nanoflow: cannot pin unit %s to %s: %s", self.name, self.cores, err)
        torch.ones(4096).sum()  # trigger torch's lazy per-thread init before overriding it
        set_num_threads(self.num_threads)

    def launch(self, fn: Callable[[], Any]) -> None:
        fn()
        return None

    def describe(self) -> dict:
        return {**super().describe(), "cores": list(self.cores), "num_threads": self.num_threads}


class CudaSmStream(ExecutionUnit):
    """A CUDA stream capped at `sm_count` SMs via a green context (fallback: uncapped stream)."""

    def __init__(self, name: str, sm_count: int, device: int = 0) -> None:
        super().__init__(name, sm_count)
        self.device = device
        self.stream, self.capped = _green_stream(sm_count, device)

    def bind(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    def launch(self, fn: Callable[[], Any]) -> Any:
        with torch.cuda.stream(self.stream):
            fn()
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, token: Any) -> None:
        if token is not None:
            self.stream.wait_event(token)

    def caller_token(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def join_caller(self, token: Any) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def describe(self) -> dict:
        return {**super().describe(), "sm_capped": self.capped}


def _green_stream(sm_count: int, device: int) -> tuple[Any, bool]:
    """A stream on a green context with `sm_count` SMs, or (plain stream, False)."""
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.4

        return torch.cuda.ExternalStream(_create_green_stream(cu, sm_count, device)), True
    except Exception as err:  # ImportError, old driver, unsupported GPU
        logger.warning(
            "nanoflow: CUDA green contexts unavailable (%s); unit streams are not SM-limited",
            err,
        )
        return torch.cuda.Stream(device=device, priority=-1), False


def _check(result: tuple) -> Any:
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


def _create_green_stream(cu: Any, sm_count: int, device: int) -> int:
    dev = _check(cu.cuDeviceGet(device))
    sm_resource = _check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _num, _rest = _check(cu.cuDevSmResourceSplitByCount(1, sm_resource, 0, sm_count))
    desc = _check(cu.cuDevResourceGenerateDesc([groups[0]], 1))
    green = _check(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    stream = _check(cu.cuGreenCtxStreamCreate(green, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    return int(stream)


def allowed_cores() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return tuple(range(os.cpu_count() or 1))


def make_cpu_units(shares: dict[str, int], cores: tuple[int, ...] | None = None) -> dict[str, CpuCoreGroup]:
    """Disjoint core sets in `shares` order. A share of 0 means the whole device at the caller's
    torch thread count (e.g. a unit that only waits on the network); shares beyond the core count
    reuse cores (oversubscribed, logged)."""
    cores = cores or allowed_cores()
    units, pos = {}, 0
    for name, share in shares.items():
        if share <= 0:  # the whole device, with the process's own torch width
            units[name] = CpuCoreGroup(name, cores, num_threads=min(torch.get_num_threads(), len(cores)))
            continue
        picked = tuple(cores[(pos + i) % len(cores)] for i in range(share))
        if pos + share > len(cores):
            logger.warning("nanoflow: unit %s oversubscribes cores %s", name, picked)
        pos += share
        units[name] = CpuCoreGroup(name, picked)
    return units


def make_gpu_units(shares: dict[str, int], device: int = 0) -> dict[str, CudaSmStream]:
    return {name: CudaSmStream(name, max(1, share), device) for name, share in shares.items()}


def make_units(shares: dict[str, int], device: torch.device) -> dict[str, ExecutionUnit]:
    if device.type == "cuda":
        return dict(make_gpu_units(shares, device.index or 0))
    return dict(make_cpu_units(shares))
