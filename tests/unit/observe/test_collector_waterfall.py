# SPDX-License-Identifier: Apache-2.0
"""The local OTLP receiver takes the SDK's real exports (gRPC and HTTP) into its JSONL file, and the
waterfall finds a request's trace there, walks its critical path and renders it."""

from __future__ import annotations

import base64
import json

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from vllm_disagg.observe import tracing
from vllm_disagg.observe.collector import SpanCollector
from vllm_disagg.observe.waterfall import Trace, find_trace, load_spans, render

MS = 1_000_000


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sdk_exports_reach_the_collector_file(tmp_path, monkeypatch, protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    with SpanCollector(tmp_path / "spans.jsonl") as collector:
        endpoint = collector.grpc_endpoint if protocol == "grpc" else collector.http_endpoint
        provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
        provider.add_span_processor(SimpleSpanProcessor(tracing.span_exporter(endpoint)))
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span("router.request", attributes={"disagg.request_id": "req-1"}) as root:
            with tracer.start_as_current_span("router.admission") as child:
                child.add_event("routed", {"disagg.route": "pd"})
        provider.shutdown()
        assert collector.wait_for(lambda s: len(s) == 2, 10)
    spans = load_spans(tmp_path / "spans.jsonl")
    t = find_trace(spans, "req-1")
    assert t is not None and t.root["name"] == "router.request"
    assert t.root["trace_id"] == f"{root.get_span_context().trace_id:032x}"
    assert t.services == {"router"}
    assert t.named("router.admission")[0]["events"][0]["attributes"] == {"disagg.route": "pd"}


def _span(name, sid, parent, start, end, service="s", **attrs):
    return {"trace_id": "t1", "span_id": sid, "parent_span_id": parent, "name": name, "start_ns": start * MS,
            "end_ns": end * MS, "service": service, "resource": {}, "attributes": attrs, "events": [], "status": 0}


def _pd_trace() -> Trace:
    return Trace([
        _span("router.request", "r", None, 0, 100, "router", **{"disagg.request_id": "abc"}),
        _span("router.admission", "a", "r", 0, 2, "router"),
        _span("router.prefill", "p", "r", 2, 30, "router"),
        _span("router.decode", "d", "r", 2, 99, "router"),
        _span("llm_request", "v", "d", 3, 98.5, "decode0"),  # vLLM's summary span: no children, ends 8.5 ms later
        _span("decode.queue", "q", "d", 3, 4, "decode0"),
        _span("kv.wait", "w", "d", 4, 25, "decode0"),
        _span("kv.push", "k", "w", 5, 24, "prefill0"),
        _span("decode.first_step", "f", "d", 25, 30, "decode0"),
        _span("decode", "e", "d", 30, 90, "decode0"),
    ])


def test_critical_path_prefers_the_specific_spans_over_a_summary_span_ending_with_them():
    t = _pd_trace()
    names = [s["name"] for s, _, _ in t.critical_path()]
    assert names == ["router.request", "router.admission", "router.decode", "decode.queue", "kv.wait", "kv.push",
                     "decode.first_step", "decode"]
    assert t.coverage() == pytest.approx(0.99)  # admission 0-2 + decode call 2-99
    assert t.coverage(t.named("router.decode")[0]) == pytest.approx(87 / 97)


def test_find_trace_by_request_id_trace_id_or_an_id_that_embeds_it():
    spans = _pd_trace().spans
    assert find_trace(spans, "abc").root["name"] == "router.request"
    assert find_trace(spans, "t1") is not None
    spans[0]["attributes"]["disagg.request_id"] = "cmpl-abc-0"
    assert find_trace(spans, "abc") is not None
    assert find_trace(spans, "zzz") is None


def test_render_marks_the_critical_path_and_sums_self_time():
    text = render(_pd_trace())
    lines = text.splitlines()
    assert lines[0].startswith("trace t1  100.0 ms  10 spans from 3 processes")
    assert any("*" in ln and "kv.push [prefill0]" in ln for ln in lines)
    assert any("llm_request [decode0]" in ln and "*" not in ln.split("llm_request")[0][-3:] for ln in lines)
    assert "critical path covers 99.0 %" in text


def test_a_push_waiting_for_prefill_layers_is_not_called_transfer_time():
    """kv.push runs beside P's prefill (layer by layer): the real trace in observe/README.md put 206 ms
    of it on the critical path, 205 of them before P's last layer (`prefill_done`)."""
    t = _pd_trace()
    t.named("kv.push")[0]["events"].append({"name": "prefill_done", "time_ns": 22 * MS, "attributes": {}})
    text = render(t)
    assert "19.0 ms  kv.push [prefill0]" not in text
    assert "17.0 ms  kv.push [prefill0] waiting for P's prefill layers" in text
    assert "2.0 ms  kv.push [prefill0]" in [ln.strip() for ln in text.splitlines()]


def test_a_trace_missing_its_parents_says_it_is_incomplete():
    spans = [s for s in _pd_trace().spans if s["name"] != "router.request"]  # the router's root not flushed yet
    text = render(Trace(spans))
    assert "incomplete: the parents of 3 spans are not here" in text.splitlines()[1]
    assert "incomplete" not in render(_pd_trace())


def test_an_opentelemetry_collectors_otlp_json_file_reads_the_same(tmp_path):
    """What the OTel Collector's `file` exporter writes: one ExportTraceServiceRequest as JSON per line."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("router.request", attributes={"disagg.request_id": "j1"}):
        pass
    obj = json_format.MessageToDict(encode_spans(exporter.get_finished_spans()))
    span = obj["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = base64.b64decode(span["traceId"]).hex()  # OTLP/JSON: ids in hex
    span["spanId"] = base64.b64decode(span["spanId"]).hex()
    (tmp_path / "otel.json").write_text(json.dumps(obj) + "\n")
    t = find_trace(load_spans(tmp_path / "otel.json"), "j1")
    assert t is not None and t.root["service"] == "router" and t.root["trace_id"] == span["traceId"]
