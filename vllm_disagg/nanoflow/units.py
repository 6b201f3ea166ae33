# SPDX-License-Identifier: Apache-2.0
"""Execution units: bounded shares of the device that concurrent op streams run on.

One interface, two implementations:
- `CpuCoreGroup`: a thread group pinned to a core set (`os.sched_setaffinity` on the unit's own
  thread, whose OpenMP team inherits the mask) with its own torch intra-op thread count.
- `CudaSmStream`: a CUDA stream on its own SM partition through a CUDA green context
  (`cuda-python` driver API, CUDA >= 12.4); `make_gpu_units` gives units disjoint partitions.
  Fallback when green contexts are unavailable: a plain high-priority `torch.cuda.Stream` with no
  SM cap (logged). Untested here (no GPU): the GPU kit's step b runs it (`docs/gpu.md`).

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
    """A CUDA stream on its own SM partition (a green context); `stream=None` makes one from a
    partition of the whole device (fallback: an uncapped stream, logged). `make_gpu_units` hands
    each unit a disjoint partition."""

    def __init__(self, name: str, sm_count: int, device: int = 0, stream: Any = None, capped: bool = False) -> None:
        super().__init__(name, sm_count)
        self.device = device
        if stream is None:
            stream, capped = _green_stream(sm_count, device)
        self.stream, self.capped = stream, capped

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
        ((stream, _),) = green_partitions([sm_count], device)
        return stream, True
    except Exception as err:  # ImportError, old driver, unsupported GPU, sandbox
        logger.warning("nanoflow: CUDA green contexts unavailable (%s); unit streams are not SM-limited", err)
        return torch.cuda.Stream(device=device, priority=-1), False


def green_partitions(sm_counts: list[int], device: int = 0) -> list[tuple[Any, int]]:
    """Disjoint SM partitions of `device`, one green-context stream each: [(stream, SMs granted)].

    Each partition is split off what the previous ones left (splitting the whole device again would
    hand every unit the same first SMs). A split's output cannot be split again directly, so what is
    left goes through a green context of its own first (`cuGreenCtxGetDevResource`). The driver
    rounds counts up to its granularity (8 SMs on Hopper); the last count takes all that is left when
    it asks for at least that. Raises when the driver or the runtime refuses (cuda-python >= 12.4)."""
    from cuda.bindings import driver as cu

    torch.cuda.init()
    dev = _check(cu.cuDeviceGet(device))
    sm_type = cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    rest = _check(cu.cuDeviceGetDevResource(dev, sm_type))
    out = []
    for i, count in enumerate(sm_counts):
        if i == len(sm_counts) - 1 and count >= rest.sm.smCount:
            part = rest  # the last unit takes what is left
        else:
            if i:  # `rest` came out of a split: make it splittable through a context of its own
                rest = _check(cu.cuGreenCtxGetDevResource(_green_context(cu, dev, rest), sm_type))
            groups, _num, rest = _check(cu.cuDevSmResourceSplitByCount(1, rest, 0, count))
            part = groups[0]
        green = _green_context(cu, dev, part)
        stream = _check(cu.cuGreenCtxStreamCreate(green, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        out.append((torch.cuda.ExternalStream(int(stream), device=torch.device("cuda", device)),
                    int(part.sm.smCount)))
    return out


def _green_context(cu: Any, dev: Any, resource: Any) -> Any:
    desc = _check(cu.cuDevResourceGenerateDesc([resource], 1))
    green = _check(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    _GREEN_CONTEXTS.append(green)  # never destroyed: streams on it live as long as the process
    return green


_GREEN_CONTEXTS: list[Any] = []


def _check(result: tuple) -> Any:
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


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
    """One unit per share on disjoint SM partitions (green contexts); plain streams, logged, where the
    driver or runtime refuses them."""
    counts = [max(1, share) for share in shares.values()]
    try:
        parts = green_partitions(counts, device)
    except Exception as err:
        logger.warning("nanoflow: CUDA green contexts unavailable (%s); unit streams are not SM-limited", err)
        return {name: CudaSmStream(name, count, device, torch.cuda.Stream(device=device, priority=-1))
                for name, count in zip(shares, counts)}
    return {name: CudaSmStream(name, granted, device, stream, capped=True)
            for name, (stream, granted) in zip(shares, parts)}


def make_units(shares: dict[str, int], device: torch.device) -> dict[str, ExecutionUnit]:
    if device.type == "cuda":
        return dict(make_gpu_units(shares, device.index or 0))
    return dict(make_cpu_units(shares))
