# SPDX-License-Identifier: Apache-2.0
"""A local OTLP trace receiver: gRPC and HTTP/protobuf on 127.0.0.1, spans appended to a JSONL file.

It is what `vllm-disagg up --trace` runs and what the tests run, so a trace needs no extra
infrastructure: every process exports to it, `vllm-disagg trace REQUEST_ID` reads its file. Each line
is one span as a flat dict (`span_to_dict`), the format `waterfall.load_spans` reads back. A real
collector (Jaeger, Tempo, the OTel collector) takes the same exports instead.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["SpanCollector", "request_spans", "span_to_dict"]


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _process(resource: dict[str, Any]) -> str:
    """`service[/EngineCore|/Worker_0]:pid`: vLLM's API server, engine core and workers share a service."""
    name = str(resource.get("service.name", ""))
    if resource.get("vllm.process_name"):
        name += f"/{resource['vllm.process_name']}"
    pid = resource.get("vllm.process_id") or resource.get("process.pid")
    return f"{name}:{pid}" if pid else name


def span_to_dict(span, resource: dict[str, Any]) -> dict[str, Any]:
    """One OTLP protobuf span as plain JSON: ids in hex, times in ns since the epoch."""
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "name": span.name,
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "service": str(resource.get("service.name", "")),
        "process": _process(resource),
        "resource": resource,
        "attributes": _attrs(span.attributes),
        "events": [{"name": e.name, "time_ns": e.time_unix_nano, "attributes": _attrs(e.attributes)}
                   for e in span.events],
        "status": span.status.code,
    }


def request_spans(request) -> list[dict[str, Any]]:
    """The spans of an OTLP `ExportTraceServiceRequest`, as `span_to_dict`s."""
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            out += [span_to_dict(s, resource) for s in ss.spans]
    return out


class SpanCollector:
    """Receives OTLP exports (gRPC on `grpc_port`, HTTP `POST /v1/traces` on `http_port`, both on
    127.0.0.1 and picked by the OS when 0) and keeps every span, in memory and in `path` if given."""

    def __init__(self, path: str | Path | None = None, host: str = "127.0.0.1") -> None:
        self.path = Path(path) if path is not None else None
        self.host = host
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._grpc = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port = self.http_port = 0

    # ------------------------------------------------------------- endpoints
    @property
    def grpc_endpoint(self) -> str:
        """Value for `--otlp-traces-endpoint` (vLLM's default protocol, grpc)."""
        return f"http://{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """Endpoint for `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` exporters."""
        return f"http://{self.host}:{self.http_port}/v1/traces"

    def start(self) -> SpanCollector:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as svc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        collector = self

        class _Servicer(svc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - gRPC method name
                collector.add_request(request)
                return ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        svc.add_TraceServiceServicer_to_server(_Servicer(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.host}:0")
        self._grpc.start()
        self._http = ThreadingHTTPServer((self.host, 0), _http_handler(self))
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
        logger.info("OTLP receiver: grpc %s, http %s, spans to %s", self.grpc_endpoint, self.http_endpoint,
                    self.path)
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait(5)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def __enter__(self) -> SpanCollector:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------- intake
    def add_request(self, request) -> None:
        """Store every span of an `ExportTraceServiceRequest`."""
        new = request_spans(request)
        with self._cond:
            self.spans += new
            if self.path is not None and new:
                with self.path.open("a") as f:
                    f.writelines(json.dumps(s) + "\n" for s in new)
            self._cond.notify_all()

    def wait_for(self, predicate, timeout_s: float) -> bool:
        """Block until `predicate(spans)` holds (re-checked on each export) or `timeout_s` passes."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.spans), timeout=timeout_s)


def _http_handler(collector: SpanCollector):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

            if self.path.rstrip("/") != "/v1/traces":
                self.send_error(404, "OTLP traces are posted to /v1/traces")
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                import gzip

                body = gzip.decompress(body)
            request = ExportTraceServiceRequest()
            try:
                request.ParseFromString(body)
            except Exception as exc:  # noqa: BLE001 - a bad export is the sender's error, not ours
                self.send_error(400, f"not an OTLP protobuf ExportTraceServiceRequest: {exc}")
                return
            collector.add_request(request)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):  # quiet: one line per export would flood the log
            pass

    return Handler
