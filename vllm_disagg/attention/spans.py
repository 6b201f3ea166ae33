# SPDX-License-Identifier: Apache-2.0
"""Spans of sampled attention-server calls: `attention.step` on the model worker, `attention.serve`
on each server, one per sampled decode step, with an event per layer.

The connector's scheduler half picks the steps (`kv/spans.py`, every Nth step of a traced request)
and its worker half hands the choice over (`set_step_trace`). On the model worker, layer 0 of that
step opens `attention.step` (child of the request's decode span) and puts its context on the step's
metadata frame (wire v4 HAS_TRACE); the last layer's answer ends it. A server that receives a step
with a sampled context opens `attention.serve` under it and ends it after the last layer. Untraced
steps cost one None check per layer.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_disagg.observe import tracing

__all__ = ["ServeSpans", "begin_step", "end_step", "set_step_trace"]

_STEP_TRACE: Any = None  # TraceContext of the step the worker runs next (set on bind, per step)
_OPEN: dict[int, Any] = {}  # id(ClientMeta) -> its attention.step span


def set_step_trace(trace: Any) -> None:
    """The worker half of the connector, once per step: the sampled request's context, or None."""
    global _STEP_TRACE
    _STEP_TRACE = trace


def begin_step(layer: int, meta: Any) -> None:
    """Layer 0 of a sampled step: open `attention.step` and send its context with the step metadata."""
    if layer != 0 or _STEP_TRACE is None or getattr(meta, "trace", None) is not None:
        return
    if not _STEP_TRACE.sampled or not tracing.enabled():
        return
    if len(_OPEN) > 64:  # steps that never reached their last layer (a failed call): drop them
        _OPEN.clear()
    span = tracing.start_span("attention.step", tracing.from_wire(_STEP_TRACE), attributes={
        "disagg.num_tokens": int(getattr(meta, "num_actual_tokens", 0)), "disagg.num_reqs": int(meta.step.num_reqs)})
    meta.trace = tracing.to_wire(span)
    _OPEN[id(meta)] = span


def end_step(layer: int, num_layers: int, meta: Any) -> None:
    """After a layer's answer came back: an event per layer, and the span ends with the last one."""
    span = _OPEN.get(id(meta)) if _OPEN else None
    if span is None:
        return
    span.add_event("layer", {"disagg.layer": layer})
    if layer == num_layers - 1:
        del _OPEN[id(meta)]
        span.end()


class ServeSpans:
    """Per server session: the `attention.serve` span of each sampled step, by metadata id."""

    def __init__(self) -> None:
        self._open: dict[int, Any] = {}

    def frame(self, h: Any, trace: Any, started_ns: int, num_layers: int) -> None:
        """Account one handled frame (`trace`: the session's trace when this frame started a step)."""
        if h.has_meta and trace is not None and trace.sampled and tracing.enabled():
            self._open[h.meta_id] = tracing.start_span("attention.serve", tracing.from_wire(trace), started_ns,
                                                       {"disagg.num_tokens": int(h.num_tokens)})
        span = self._open.get(h.meta_id) if self._open else None
        if span is None:
            return
        span.add_event("layer", {"disagg.layer": int(h.layer), "disagg.type": h.mtype.name,
                                 "disagg.compute_us": round((time.time_ns() - started_ns) / 1e3, 1)}, started_ns)
        if h.layer == num_layers - 1 and h.mtype.name in ("ATTN", "KV"):
            self._open.pop(h.meta_id).end()

    def close(self) -> None:
        for span in self._open.values():
            span.add_event("aborted", {"disagg.reason": "session ended"})
            span.end()
        self._open.clear()
