# SPDX-License-Identifier: Apache-2.0
"""OpenTelemetry tracing of one request across router, P, D, KV push and attention servers.

Off by default. vLLM processes trace when started with vLLM's own `--otlp-traces-endpoint` (vLLM
installs the tracer provider in its API server, EngineCore and workers; our spans use it). The
router and the attention servers call `configure()` with the same flag. The router samples
(`ParentBased(TraceIdRatio)`); every other process follows the sampled flag it receives.
Context travels as W3C `traceparent` in HTTP headers and as `TraceContext` (25 binary bytes,
`to_wire`/`from_wire`) in the KV side channel and attention frames. See vllm_disagg/observe/README.md.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vllm_disagg.observe.context import TraceContext

logger = logging.getLogger(__name__)

TRACER_NAME = "vllm_disagg"
DEFAULT_SAMPLE_RATIO = 1.0
_PROPAGATOR = TraceContextTextMapPropagator()
_configured_here = False

__all__ = [
    "DEFAULT_SAMPLE_RATIO", "configure", "context_from_headers", "context_of", "enabled", "from_wire",
    "headers_for", "sampled_context", "shutdown", "start_span", "to_wire", "trace_id_hex", "tracer", "wall_ns",
]


def configure(service_name: str, endpoint: str | None, sample_ratio: float = DEFAULT_SAMPLE_RATIO,
              attributes: Mapping[str, str] | None = None) -> bool:
    """Install an exporting tracer provider in this (non-vLLM) process; False when `endpoint` is None.

    `endpoint` is an OTLP collector: gRPC (`http://host:4317`, vLLM's default protocol) unless
    `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` (then `http://host:4318/v1/traces`). Child
    processes inherit the endpoint through `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, as vLLM does."""
    global _configured_here
    if not endpoint:
        return False
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"trace sample ratio must be in [0, 1], got {sample_ratio}")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name,
                                "process.pid": os.getpid(), **(attributes or {})})
    provider = TracerProvider(sampler=ParentBasedTraceIdRatio(sample_ratio), resource=resource,
                              id_generator=_SystemRandomIds())
    provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
    trace.set_tracer_provider(provider)
    _configured_here = True
    logger.info("tracing on: OTLP to %s, sample ratio %g", endpoint, sample_ratio)
    return True


def span_exporter(endpoint: str):
    """The OTLP exporter for `endpoint`, by `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (grpc as in vLLM)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: expected grpc or http/protobuf")


def shutdown() -> None:
    """Flush and stop the provider `configure()` installed (a no-op otherwise)."""
    provider = trace.get_tracer_provider()
    if _configured_here and hasattr(provider, "shutdown"):
        provider.shutdown()


def enabled() -> bool:
    """Whether this process exports spans (vLLM's provider or ours): callers skip all work if not.

    A provider is set once per process, so a True answer is kept."""
    global _enabled
    if not _enabled:
        _enabled = type(trace.get_tracer_provider()).__module__.startswith("opentelemetry.sdk")
    return _enabled


_enabled = False


def tracer() -> trace.Tracer:
    _unseeded_ids()
    return trace.get_tracer(TRACER_NAME)


class _SystemRandomIds:
    """Span and trace ids from the OS's randomness. The SDK's default draws them from Python's
    `random`, which vLLM seeds (`--seed`) in its engine and workers: every instance started with the
    same seed then made the same span ids, and P's spans became D's parents (cycles in a trace)."""

    _random = random.SystemRandom()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


def _unseeded_ids() -> None:
    """Give this process's SDK provider (vLLM's or ours) unseeded ids, once."""
    global _ids_fixed
    if _ids_fixed or not enabled():
        return
    provider = trace.get_tracer_provider()
    if type(getattr(provider, "id_generator", None)).__name__ == "RandomIdGenerator":
        provider.id_generator = _SystemRandomIds()
    _ids_fixed = True


_ids_fixed = False


def wall_ns(t_monotonic: float | None = None) -> int:
    """Epoch nanoseconds of a `time.monotonic()` reading (now when None): spans carry wall time."""
    if t_monotonic is None:
        return time.time_ns()
    return time.time_ns() - time.monotonic_ns() + int(t_monotonic * 1e9)


def start_span(name: str, parent: otel_context.Context | None, start_ns: int | None = None,
               attributes: Mapping[str, Any] | None = None) -> trace.Span:
    """A span under `parent` (a remote context), started at `start_ns` (now when None); the caller ends
    it. Spans of one request cross threads and steps here, so none is made current."""
    return tracer().start_span(name, context=parent, start_time=start_ns, attributes=attributes)


def sampled_context(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """`context_from_headers`, but only for a sampled trace in a process that exports: None means
    "record nothing for this request" (the hot-path check of every hook)."""
    if not headers or not enabled():
        return None
    ctx = context_from_headers(headers)
    if ctx is None or not trace.get_current_span(ctx).get_span_context().trace_flags.sampled:
        return None
    return ctx


# ----------------------------------------------------------------- propagation
def context_from_headers(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The parent context in W3C headers (`traceparent`, `tracestate`); None when absent."""
    if not headers or not any(k.lower() == "traceparent" for k in headers):
        return None
    ctx = _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def headers_for(span_or_context: Any) -> dict[str, str]:
    """`traceparent` (+ `tracestate`) naming `span_or_context` as parent; {} when it is not valid."""
    ctx = _as_context(span_or_context)
    if ctx is None:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def to_wire(span_or_context: Any) -> TraceContext | None:
    """The wire form (`TraceContext`, 25 bytes on the KV side channel and attention frames) naming
    `span_or_context` as parent; None when there is none."""
    sc = _span_context(span_or_context)
    if sc is None:
        return None
    return TraceContext(sc.trace_id.to_bytes(16, "big"), sc.span_id.to_bytes(8, "big"), int(sc.trace_flags) & 0xFF)


def from_wire(wire: TraceContext | None) -> otel_context.Context | None:
    """The parent context a `TraceContext` names (None for None)."""
    if wire is None:
        return None
    sc = SpanContext(int.from_bytes(wire.trace_id, "big"), int.from_bytes(wire.parent_span_id, "big"),
                     is_remote=True, trace_flags=TraceFlags(wire.flags & 0x01))
    return trace.set_span_in_context(NonRecordingSpan(sc))


def trace_id_hex(span_or_context: Any = None) -> str | None:
    """32 hex digits of the trace id (of the current span when None), or None."""
    sc = _span_context(span_or_context if span_or_context is not None else trace.get_current_span())
    return None if sc is None else f"{sc.trace_id:032x}"


def _span_context(obj: Any) -> SpanContext | None:
    if obj is None:
        return None
    if isinstance(obj, SpanContext):
        sc = obj
    elif isinstance(obj, trace.Span):
        sc = obj.get_span_context()
    else:  # a Context
        sc = trace.get_current_span(obj).get_span_context()
    return sc if sc.is_valid else None


def context_of(span_or_context: Any) -> otel_context.Context | None:
    """A context whose current span is `span_or_context` (the parent argument of `start_span`)."""
    return _as_context(span_or_context)


def _as_context(obj: Any) -> otel_context.Context | None:
    sc = _span_context(obj)
    return None if sc is None else trace.set_span_in_context(NonRecordingSpan(sc))
