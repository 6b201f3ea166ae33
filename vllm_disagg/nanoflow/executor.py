# SPDX-License-Identifier: Apache-2.0
"""Runs one step's op graph on execution units, like CUDA streams plus events.

Lifecycle: `OpGraphExecutor(units)` starts one persistent thread per unit (bound once to its core
set / stream). `run(nodes, schedule, fns)` hands every unit its ops in scheduled order; a unit
thread waits for an op's cross-unit dependencies (threading events; on GPU also a stream wait on
the dependency's CUDA event), launches it, and signals it. The call returns when all ops are done
and the network side work submitted during the step has drained. The first error aborts the step
and is re-raised on the caller's thread. With `inline=True` (one unit, nothing to overlap) the ops
run on the caller's thread in the schedule's global order: the paper's "nano-batch only" mode.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm_disagg.nanoflow import overlap
from vllm_disagg.nanoflow.graph import OpKey, OpNode, Schedule
from vllm_disagg.nanoflow.units import ExecutionUnit

logger = logging.getLogger(__name__)

DEP_WAIT_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 900.0
OpFn = Callable[[], Any]


class StepAborted(RuntimeError):
    """Another unit failed; this unit stops without running its remaining ops."""


class _Step:
    """Shared state of one step across unit threads."""

    def __init__(self, nodes: Sequence[OpNode], fns: dict[OpKey, OpFn], n_batches: dict[str, int]) -> None:
        self.nodes = {n.key: n for n in nodes}
        self.fns = fns
        self.n_batches = dict(n_batches)
        for n in nodes:
            self.n_batches.setdefault(n.name, 0)
            self.n_batches[n.name] = max(self.n_batches[n.name], n.nb + 1)
        self.done = {key: threading.Event() for key in self.nodes}
        self.tokens: dict[OpKey, Any] = {}
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.start_token: Any = None

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = err
        for ev in self.done.values():  # wake every waiter
            ev.set()

    def run_op(self, unit: ExecutionUnit, key: OpKey) -> None:
        node = self.nodes[key]
        for dep in node.deps:
            if not self.done[dep].wait(DEP_WAIT_TIMEOUT_S):
                raise TimeoutError(f"nanoflow: op {key} waited {DEP_WAIT_TIMEOUT_S}s for {dep}")
            if self.error is not None:
                raise StepAborted()
            if self.nodes[dep].unit != node.unit:
                unit.wait(self.tokens.get(dep))
        name, layer, nb = key
        overlap.set_current_nano_batch(overlap.NanoBatchInfo(nb, self.n_batches.get(name, 1), layer, name))
        try:
            self.tokens[key] = unit.launch(self.fns[key])
        finally:
            overlap.set_current_nano_batch(None)
        self.done[key].set()


class _UnitThread:
    def __init__(self, unit: ExecutionUnit) -> None:
        self.unit = unit
        self.inbox: queue.Queue = queue.Queue()
        self.bound = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"nanoflow-{unit.name}", daemon=True)
        self.thread.start()
        self.bound.wait(30)

    def _loop(self) -> None:
        import torch

        try:
            self.unit.bind()
        finally:
            self.bound.set()
        while True:
            item = self.inbox.get()
            if item is None:
                return
            step, keys, finished = item
            try:
                self.unit.wait(step.start_token)  # GPU: the caller's inputs are ready
                with torch.inference_mode():
                    for key in keys:
                        if step.error is not None:
                            break
                        step.run_op(self.unit, key)
            except StepAborted:
                pass
            except BaseException as err:  # re-raised on the caller's thread
                step.fail(err)
            finally:
                finished.set()


class OpGraphExecutor:
    """Executes scheduled op graphs on a fixed set of units."""

    def __init__(self, units: dict[str, ExecutionUnit], inline: bool = False) -> None:
        self.units = units
        self.inline = inline or len(units) <= 1
        self._threads: dict[str, _UnitThread] = {}
        if not self.inline:
            self._threads = {name: _UnitThread(u) for name, u in units.items()}

    def run(
        self,
        nodes: Sequence[OpNode],
        schedule: Schedule,
        fns: dict[OpKey, OpFn],
        n_batches: dict[str, int] | None = None,
    ) -> None:
        step = _Step(nodes, fns, n_batches or {})
        if self.inline:
            self._run_inline(step, schedule)
        else:
            self._run_threaded(step, schedule)
        overlap.drain_network()

    def _run_inline(self, step: _Step, schedule: Schedule) -> None:
        unit = next(iter(self.units.values()), None)
        for key in schedule.global_order():
            if unit is None:
                step.fns[key]()
                continue
            step.run_op(unit, key)

    def _run_threaded(self, step: _Step, schedule: Schedule) -> None:
        missing = set(schedule.order) - set(self._threads)
        if missing:
            raise ValueError(f"schedule uses units {sorted(missing)} that this executor lacks")
        any_unit = next(iter(self.units.values()))
        step.start_token = any_unit.caller_token()
        waits = []
        for name, keys in schedule.order.items():
            finished = threading.Event()
            self._threads[name].inbox.put((step, keys, finished))
            waits.append(finished)
        for finished in waits:
            if not finished.wait(STEP_TIMEOUT_S):
                step.fail(TimeoutError(f"nanoflow: step exceeded {STEP_TIMEOUT_S}s"))
                raise step.error  # type: ignore[misc]
        if step.error is not None:
            raise step.error
        for name, keys in schedule.order.items():
            if keys:
                self.units[name].join_caller(step.tokens.get(keys[-1]))

    def shutdown(self) -> None:
        for t in self._threads.values():
            t.inbox.put(None)
        for t in self._threads.values():
            t.thread.join(timeout=5)
        self._threads.clear()
