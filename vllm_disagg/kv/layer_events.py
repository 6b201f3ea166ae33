# SPDX-License-Identifier: Apache-2.0
"""Per-layer completion events: the KV sender reads a layer only after the kernels that wrote it ran.

On a GPU, vLLM calls `save_kv_layer` when a layer's attention (and its KV-cache write) has been
*queued* on the forward stream, not when it has run. `DeviceEvents.record()` puts an event on that
stream; the sender thread waits on it before a write reads the layer's blocks. On CPU the kernels
have finished when the hook runs, so `record()` returns the completed `DONE`. `StreamTwin` is a
CPU stand-in for a stream (ops run later, in order, on its own thread): the tests check the
ordering the CUDA path relies on through this same interface.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["DONE", "DeviceEvents", "LayerEvent", "StreamTwin", "device_events"]


class LayerEvent(Protocol):
    """Completion of the work queued before `record()` (one CUDA event, or its twin)."""

    def query(self) -> bool:
        """True once that work has finished (never blocks)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block until it has finished or `timeout_s` passed; True when finished."""
        ...


class _Done:
    """The event of work that already ran (CPU kernels are synchronous)."""

    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> bool:
        return True

    def __repr__(self) -> str:
        return "DONE"


DONE: LayerEvent = _Done()


class DeviceEvents(Protocol):
    def record(self) -> LayerEvent:
        """An event on the calling thread's current stream of this device."""
        ...


class _CpuEvents:
    def record(self) -> LayerEvent:
        return DONE


class _CudaEvent:
    """A torch CUDA event recorded on the current stream; `wait` polls, so it can time out."""

    __slots__ = ("_event",)

    def __init__(self, device: Any) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def query(self) -> bool:
        return self._event.query()

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        pause = 1e-5
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)
        return True


class _CudaEvents:
    def __init__(self, device: Any) -> None:
        self.device = device

    def record(self) -> LayerEvent:
        return _CudaEvent(self.device)


def device_events(device: Any) -> DeviceEvents:
    """The event source for KV tensors on `device` (a torch.device, or anything with `.type`)."""
    if getattr(device, "type", device) == "cuda":
        return _CudaEvents(device)
    return _CpuEvents()


class _TwinEvent:
    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class StreamTwin:
    """A CPU stream: `submit(fn)` queues work that a thread runs later, in order; `record()` gives
    an event that completes when everything submitted before it has run (like `cudaEventRecord`)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="stream-twin", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> None:
        self._queue.put(fn)

    def record(self) -> LayerEvent:
        event = _TwinEvent()
        self._queue.put(event._done.set)
        return event

    def synchronize(self, timeout_s: float = 30.0) -> None:
        if not self.record().wait(timeout_s):
            raise TimeoutError("stream twin did not drain")

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - kept for the test to assert on
                self.errors.append(err)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
