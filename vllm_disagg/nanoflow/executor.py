# SPDX-License-Identifier: Apache-2.0
"""Runs one step's op graph on execution units, like CUDA streams plus events.

Lifecycle: `OpGraphExecutor(units)` starts one persistent thread per unit (bound once to its core
set / stream). `run(nodes, schedule, fns)` hands every unit its ops in scheduled order; a unit
thread waits for an op's cross-unit dependencies (threading events; on GPU also a stream wait on
the dependency's CUDA event), launches it, and signals it. The call returns when all ops are done
and the network side work submitted during the step has drained. The first error aborts the step
and is re-raised on the caller's thread. With `inline=True` (one unit, nothing to overlap) the ops
run on the caller's thread in the schedule's global order: the paper's "nano-batch only" mode.

More: README.md, "executor.py".
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from vllm_disagg import overlap
from vllm_disagg.nanoflow.graph import OpKey, OpNode, Schedule
from vllm_disagg.nanoflow.units import ExecutionUnit

logger = logging.getLogger(__name__)

DEP_WAIT_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 900.0
OpFn = Callable[[], Any]

MAX_PREPARED = 64
CPU_KERNEL_LOCK = threading.Lock()
"""Held by ops on exclusive units: vLLM's CPU attention and GEMM kernels share one scratchpad."""


def _call(fn: OpFn) -> Any:
    return fn()


class StepAborted(RuntimeError):
    """Another unit failed; this unit stops without running its remaining ops."""


class _Prepared:
    """What a step needs that depends only on the graph and its schedule: built once per
    schedule (the runner caches schedules per pipeline shape), so a step allocates nothing but
    its completion events."""

    def __init__(self, nodes: Sequence[OpNode], schedule: Schedule, num_batches: dict[str, int]) -> None:
        self.schedule = schedule  # keeps id(schedule) unique while cached
        self.nodes = {n.key: n for n in nodes}
        counts = dict(num_batches)
        for n in nodes:
            counts[n.name] = max(counts.get(n.name, 0), n.nb + 1)
        self.info = {
            key: overlap.NanoBatchInfo(key[2], counts.get(key[0], 1), key[1], key[0]) for key in self.nodes
        }
        # same-unit deps are satisfied by the unit's own order: wait only across units
        self.waits = {
            key: tuple(d for d in n.deps if self.nodes[d].unit != n.unit) for key, n in self.nodes.items()
        }
        # only these get a completion event (creating one costs ~3-5 us, on the step's critical path)
        self.waited = tuple(sorted({d for deps in self.waits.values() for d in deps}))
        self.inline_order = [(key, self.info[key]) for key in schedule.global_order()]


class _Step:
    """Shared state of one step across unit threads."""

    def __init__(
        self,
        prep: _Prepared,
        fns: dict[OpKey, OpFn],
        exclusive_units: frozenset[str] = frozenset(),
    ) -> None:
        self.prep = prep
        self.nodes = prep.nodes
        self.exclusive_units = exclusive_units
        self.fns = fns
        self.done = {key: threading.Event() for key in prep.waited}
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
        for dep in self.prep.waits[key]:
            if not self.done[dep].wait(DEP_WAIT_TIMEOUT_S):
                raise TimeoutError(f"nanoflow: op {key} waited {DEP_WAIT_TIMEOUT_S}s for {dep}")
            if self.error is not None:
                raise StepAborted()
            unit.wait(self.tokens.get(dep))
        overlap.set_current_nano_batch(self.prep.info[key])
        try:
            if self.nodes[key].unit in self.exclusive_units:
                with CPU_KERNEL_LOCK:
                    self.tokens[key] = unit.launch(self.fns[key])
            else:
                self.tokens[key] = unit.launch(self.fns[key])
        finally:
            overlap.set_current_nano_batch(None)
        done = self.done.get(key)
        if done is not None:
            done.set()


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

    def __init__(
        self,
        units: dict[str, ExecutionUnit],
        inline: bool = False,
        exclusive_units: Collection[str] = (),
    ) -> None:
        """`exclusive_units`: units whose ops must never run at the same time as each other
        (see CPU kernel exclusion above); ignored inline, where nothing runs concurrently."""
        self.units = units
        self.inline = inline or len(units) <= 1
        self.exclusive_units = frozenset() if self.inline else frozenset(exclusive_units)
        self._prepared: dict[int, _Prepared] = {}
        self._threads: dict[str, _UnitThread] = {}
        if not self.inline:
            self._threads = {name: _UnitThread(u) for name, u in units.items()}

    def run(
        self,
        nodes: Sequence[OpNode],
        schedule: Schedule,
        fns: dict[OpKey, OpFn],
        num_batches: dict[str, int] | None = None,
    ) -> None:
        prep = self._prepare(nodes, schedule, num_batches)
        if self.inline:
            self._run_inline(prep, fns)
        else:
            self._run_threaded(_Step(prep, fns, self.exclusive_units), schedule)
        overlap.drain_network()

    def _prepare(
        self, nodes: Sequence[OpNode], schedule: Schedule, num_batches: dict[str, int] | None
    ) -> _Prepared:
        if num_batches:
            return _Prepared(nodes, schedule, num_batches)
        prep = self._prepared.get(id(schedule))
        if prep is None or prep.schedule is not schedule or len(prep.nodes) != len(nodes):
            if len(self._prepared) >= MAX_PREPARED:
                self._prepared.clear()
            prep = self._prepared[id(schedule)] = _Prepared(nodes, schedule, {})
        return prep

    def _run_inline(self, prep: _Prepared, fns: dict[OpKey, OpFn]) -> None:
        """Nothing overlaps: the global order is topological, so no dependency waits."""
        unit = next(iter(self.units.values()), None)
        launch = unit.launch if unit is not None else _call
        try:
            for key, info in prep.inline_order:
                overlap.set_current_nano_batch(info)
                launch(fns[key])
        finally:
            overlap.set_current_nano_batch(None)

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
