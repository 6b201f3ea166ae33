# SPDX-License-Identifier: Apache-2.0
"""Trace context in HTTP headers and in 25 binary bytes, and the sampling decision every hook checks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace

from vllm_disagg.observe import tracing
from vllm_disagg.observe.context import TraceContext

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_headers_round_trip_through_the_wire_form_and_back():
    ctx = tracing.context_from_headers({"Traceparent": TP})
    wire = tracing.to_wire(ctx)
    assert len(wire.to_bytes()) == 25 and wire.to_traceparent() == TP
    assert tracing.headers_for(tracing.from_wire(TraceContext.from_bytes(wire.to_bytes())))["traceparent"] == TP
    assert tracing.trace_id_hex(ctx) == "0af7651916cd43dd8448eb211c80319c"


def test_absent_or_invalid_context_is_none_never_an_error():
    assert tracing.context_from_headers(None) is None
    assert tracing.context_from_headers({"traceparent": "garbage"}) is None
    assert tracing.to_wire(None) is None
    assert tracing.from_wire(None) is None
    assert tracing.headers_for(None) == {}


@given(st.binary(min_size=16, max_size=16).filter(any), st.binary(min_size=8, max_size=8).filter(any),
       st.integers(0, 255))
def test_any_wire_context_round_trips(trace_id, span_id, flags):
    wire = TraceContext(trace_id, span_id, flags)
    back = tracing.to_wire(tracing.from_wire(wire))
    assert (back.trace_id, back.parent_span_id, back.sampled) == (trace_id, span_id, wire.sampled)


def test_sampled_context_needs_an_exporting_provider_and_the_sampled_flag(spans):
    assert tracing.enabled()
    assert tracing.sampled_context({"traceparent": TP}) is not None
    assert tracing.sampled_context({"traceparent": TP[:-2] + "00"}) is None
    assert tracing.sampled_context({}) is None


def test_start_span_is_a_child_of_the_remote_parent(spans):
    parent = tracing.context_from_headers({"traceparent": TP})
    span = tracing.start_span("x", parent, 1_000, {"a": 1})
    span.end(end_time=2_000)
    (done,) = spans()
    assert done.parent.span_id == int("b7ad6b7169203331", 16)
    assert done.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    assert (done.start_time, done.end_time) == (1_000, 2_000)
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing was made current
