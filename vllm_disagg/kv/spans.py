# SPDX-License-Identifier: Apache-2.0
"""Spans of the connector: where a P/D request's time goes on each instance.

In EngineCore, P: prefill.queue, prefill.compute; D: decode.queue, kv.wait (a failed push is a
`fallback` event with its reason: D recomputes), decode.first_step, decode; a whole request on one
instance (e.g. a Lamina model worker without P): queue, prefill, decode. The workers add `kv.push`
(P, `record_push_span`) and `kv.receive` (D: registration with P -> every byte landed, or the
failure). Each span's start and end: the table in vllm_disagg/observe/README.md.
Only requests whose `trace_headers` carry a sampled trace are tracked (vLLM passes them only when
started with `--otlp-traces-endpoint`); everything else costs one dict lookup. The kv.wait and
prefill.compute contexts go to the worker (`RecvSpec`/`SaveSpec.trace`), so P's push span joins the
trace under D's wait (D's worker sends its `kv.receive` context on REGISTER).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_disagg import envs
from vllm_disagg.observe import logs, tracing
from vllm_disagg.observe.context import TraceContext

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from vllm.v1.request import Request

__all__ = ["SchedulerSpans", "end_receive_span", "is_traced", "record_push_span", "start_receive_span"]


@dataclass
class _Tracked:
    request: Any
    parent: Any
    role: str
    open: dict[str, Span] = field(default_factory=dict)
    num_steps: int = 0


class SchedulerSpans:
    """Per-request span state of one scheduler; every method is a no-op for untraced requests."""

    def __init__(self) -> None:
        self._reqs: dict[str, _Tracked] = {}
        self._first_token: set[str] = set()  # requests whose span ends at their first output token

    def _track(self, request: Request, role: str) -> _Tracked | None:
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            parent = tracing.sampled_context(getattr(request, "trace_headers", None))
            if parent is None:
                return None
            tracked = self._reqs[request.request_id] = _Tracked(request, parent, role)
            logs.remember_trace(request.request_id, tracing.trace_id_hex(parent))
        return tracked

    def _begin(self, t: _Tracked, name: str, start_ns: int | None = None, **attrs: Any) -> Span:
        base = {"disagg.role": t.role, "disagg.request_id": t.request.request_id}
        span = tracing.start_span(name, t.parent, start_ns, {**base, **attrs})
        t.open[name] = span
        return span

    def _end(self, t: _Tracked, name: str, end_ns: int | None = None) -> None:
        span = t.open.pop(name, None)
        if span is not None:
            span.end(end_time=end_ns)

    # ------------------------------------------------------------ prefill side
    def prefill_scheduled(self, request: Request) -> TraceContext | None:
        """P allocated the request's blocks (it is scheduled): the queue span ends, compute begins.
        Returns the compute span's context for the worker's push span (None when untraced)."""
        t = self._track(request, "prefill")
        if t is None:
            return None
        now = time.time_ns()
        self._begin(t, "prefill.queue", int(request.arrival_time * 1e9)).end(end_time=now)
        span = self._begin(t, "prefill.compute", now, **{"disagg.num_prompt_tokens": request.num_prompt_tokens})
        return tracing.to_wire(span)

    def plain_scheduled(self, request: Request, restored: bool = False) -> None:
        """A whole request on this instance was scheduled: queue ends, prefill (to the first token)
        begins. `restored`: a P/D request whose KV the attention servers kept (no push; Lamina)."""
        if request.request_id in self._reqs:
            return  # resumed after a preemption: its spans go on
        t = self._track(request, "decode" if restored else "mixed")
        if t is None:
            return
        now = time.time_ns()
        self._begin(t, "queue", int(request.arrival_time * 1e9)).end(end_time=now)
        self._begin(t, "prefill", now, **{"disagg.num_prompt_tokens": request.num_prompt_tokens,
                                          "disagg.restored": restored})
        self._first_token.add(request.request_id)

    # ------------------------------------------------------------- decode side
    def decode_allocated(self, request: Request, transfer_id: str) -> TraceContext | None:
        """D allocated the blocks the push lands in: its wait for KV begins. Returns that span's
        context (it travels to P in the registration, so P's push is its child)."""
        t = self._track(request, "decode")
        if t is None:
            return None
        now = time.time_ns()
        self._begin(t, "decode.queue", int(request.arrival_time * 1e9)).end(end_time=now)
        span = self._begin(t, "kv.wait", now, **{"disagg.transfer_id": transfer_id,
                                                 "disagg.num_prompt_tokens": request.num_prompt_tokens})
        return tracing.to_wire(span)

    def kv_landed(self, req_id: str, error: str | None = None) -> None:
        """The push landed (or failed: D recomputes the prompt in its first step)."""
        t = self._reqs.get(req_id)
        if t is None or "kv.wait" not in t.open:
            return
        if error is not None:
            t.open["kv.wait"].add_event("fallback", {"disagg.reason": "recompute", "disagg.detail": error[:300]})
            t.open["kv.wait"].set_attribute("disagg.recompute", True)
        now = time.time_ns()
        self._end(t, "kv.wait", now)
        self._begin(t, "decode.first_step", now, **{"disagg.recompute": error is not None})
        self._first_token.add(req_id)

    def step_trace(self, scheduled: dict[str, int]) -> TraceContext | None:
        """Lamina: the context under which this step's attention-server calls are traced, or None.

        Every `envs.trace_attention_every()`-th step of a traced request (its first included) is
        sampled, under its open phase span (prefill, first step or decode)."""
        every = envs.trace_attention_every()
        for req_id, t in self._reqs.items():
            if req_id not in scheduled:
                continue
            span = t.open.get("decode") or t.open.get("decode.first_step") or t.open.get("prefill")
            if span is None:
                continue
            t.num_steps += 1
            if every and (t.num_steps - 1) % every == 0:
                return tracing.to_wire(span)
        return None

    def step(self) -> None:
        """Once per schedule: a request whose first token came out ends its first step (or prefill)."""
        for req_id in [r for r in self._first_token if self._reqs[r].request.num_output_tokens > 0]:
            self._to_decode(self._reqs[req_id], time.time_ns())

    def _to_decode(self, t: _Tracked, now: int) -> None:
        self._first_token.discard(t.request.request_id)
        self._end(t, "decode.first_step" if "decode.first_step" in t.open else "prefill", now)
        self._begin(t, "decode", now)

    # -------------------------------------------------------------- both sides
    def finished(self, request: Request) -> None:
        t = self._reqs.pop(request.request_id, None)
        if t is None:
            return
        now = time.time_ns()
        if request.request_id in self._first_token and request.num_output_tokens > 0:
            self._to_decode(t, now)
        self._first_token.discard(request.request_id)
        for name, span in list(t.open.items()):
            if name in ("decode", "prefill.compute"):
                span.set_attribute("disagg.num_output_tokens", request.num_output_tokens)
            else:  # aborted (client gone, error) before this phase ended
                span.add_event("aborted", {"disagg.reason": str(getattr(request, "status", "finished"))})
            self._end(t, name, now)


def is_traced(push: Any) -> bool:
    """Whether a push has a trace context (its own or its registration's): it gets a `kv.push` span."""
    return push.trace is not None or (push.reg is not None and push.reg.trace is not None)


def record_push_span(push: Any, num_layers: int) -> None:
    """The `kv.push` span of a traced push that is over (from its first sign on P: the request's first
    step or D's registration, whichever came first): one event per write (layer, bytes), the total
    bytes and the exposed time (push end - prefill end: what layer-wise pushing did not hide). Its
    parent is D's `kv.receive` (the REGISTER's trace context), else P's `prefill.compute`."""
    from opentelemetry.trace import Status, StatusCode

    wire = push.reg.trace if push.reg is not None and push.reg.trace is not None else push.trace
    if wire is None or not wire.sampled:
        return
    parent = tracing.from_wire(wire)
    end = push.t_done or time.monotonic()
    exposed = end - push.t_prefill_done if push.t_prefill_done else None
    start = min(push.t_created, push.reg.t_arrival) if push.reg is not None else push.t_created
    span = tracing.start_span("kv.push", parent, tracing.wall_ns(start), {
        "disagg.transfer_id": push.transfer_id, "disagg.layerwise": push.layerwise,
        "disagg.num_layers": num_layers, "disagg.num_writes": len(push.handles),
        "disagg.bytes": sum(h[3] for h in push.handles), "disagg.num_prompt_tokens": push.num_prompt_tokens,
        **({"disagg.exposed_ms": round(exposed * 1e3, 3)} if exposed is not None else {}),
    })
    if push.reg is not None:
        span.add_event("registered", {"disagg.decode": push.reg.address}, tracing.wall_ns(push.reg.t_arrival))
    if push.t_prefill_done:
        span.add_event("prefill_done", {}, tracing.wall_ns(push.t_prefill_done))
    for _, layer, t_issue, nbytes in push.handles:
        span.add_event("layer", {"disagg.layer": layer, "disagg.bytes": nbytes}, tracing.wall_ns(t_issue))
    if push.error is not None:
        span.add_event("failed", {"disagg.reason": push.error[:300]}, tracing.wall_ns(end))
        span.set_status(Status(StatusCode.ERROR, push.error[:300]))
    span.end(end_time=tracing.wall_ns(end))


def start_receive_span(spec: Any, expected_bytes: int) -> Span | None:
    """D's worker starts receiving a traced push (child of the scheduler's kv.wait)."""
    parent = tracing.from_wire(spec.trace)
    if parent is None or not spec.trace.sampled:
        return None
    return tracing.start_span("kv.receive", parent, attributes={
        "disagg.transfer_id": spec.transfer_id, "disagg.prefill": spec.remote, "disagg.expected_bytes": expected_bytes,
        "disagg.request_id": spec.req_id})


def end_receive_span(span: Span, landed_bytes: int, error: str | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("disagg.bytes", landed_bytes)
    if error is not None:
        span.add_event("failed", {"disagg.reason": error[:300]})
        span.set_status(Status(StatusCode.ERROR, error[:300]))
    span.end()
