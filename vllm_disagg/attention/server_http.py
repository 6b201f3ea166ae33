# SPDX-License-Identifier: Apache-2.0
"""The attention server's HTTP side: its Prometheus series and the handler of `/health` (`/info`),
`/metrics`, `/kv/retained` (token required), `/kv/landed` and `/kv/checksums` (token required)
(prefill pushes, when it takes them).
The session and dispatch side is `server.py`; `queries.py` is the client of these paths."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm_disagg.attention import wire
from vllm_disagg.logs import init_logger

if TYPE_CHECKING:
    from vllm_disagg.attention.server import DisaggAttentionServer

logger = init_logger(__name__)


class ServerMetrics:
    """The server's Prometheus series, in its own registry (several servers may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.layer_seconds = Histogram(
            "vllm:disagg_attention_layer_seconds", "Server compute time per layer call", ["layer"],
            registry=r, buckets=(5e-6, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.2, 1.0),
        )
        self.bytes_in = Counter("vllm:disagg_attention_bytes_in", "Payload bytes received", registry=r)
        self.bytes_out = Counter("vllm:disagg_attention_bytes_out", "Payload bytes sent", registry=r)
        self.messages = Counter("vllm:disagg_attention_messages", "Messages handled", ["type"], registry=r)
        self.errors = Counter("vllm:disagg_attention_errors", "Frames answered with ERROR", registry=r)
        self.busy = Counter("vllm:disagg_attention_busy_seconds",
                            "Seconds spent handling messages (frame checks, kernel, reply); the rest is idle",
                            registry=r)
        self.queue = Gauge("vllm:disagg_attention_queue_depth", "Messages received, not yet answered",
                           registry=r)
        self.sessions = Gauge("vllm:disagg_attention_sessions", "Connected model workers", registry=r)
        self.retained = Gauge("vllm:disagg_attention_retained_blocks",
                              "Blocks kept from an earlier session, restorable by key", registry=r)
        self.registered = Gauge("vllm:disagg_attention_registered_blocks",
                                "Blocks the current session registered (kept if its model worker restarts)",
                                registry=r)
        self.retained_copy_bytes = Gauge("vllm:disagg_attention_retained_copy_bytes",
                                         "Bytes of retained blocks moved aside by copy-on-write", registry=r)
        self.restored = Counter("vllm:disagg_attention_restored_blocks",
                                "Blocks restored from the retained set into a new session", registry=r)
        self.restore_misses = Counter("vllm:disagg_attention_restore_misses",
                                      "Blocks asked for by RESTORE whose key was not retained", registry=r)
        self._layer_children: dict[int, object] = {}
        self._message_children: dict[int, object] = {}

    def layer(self, layer: int):
        """The histogram child of `layer` (labels() costs a lock and a tuple per call: cache it)."""
        child = self._layer_children.get(layer)
        if child is None:
            child = self._layer_children[layer] = self.layer_seconds.labels(str(layer))
        return child

    def message(self, mtype: int):
        child = self._message_children.get(mtype)
        if child is None:
            child = self._message_children[mtype] = self.messages.labels(wire.TYPE_NAMES[mtype])
        return child


def handler_for(server: DisaggAttentionServer) -> type[BaseHTTPRequestHandler]:
    """The HTTP handler class of `server` (one per server: http.server instantiates it per request)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path in ("/health", "/info"):
                body, ctype = json.dumps(server.info()).encode(), "application/json"
            elif self.path == "/metrics":
                body, ctype = generate_latest(server.metrics.registry), "text/plain; version=0.0.4"
            elif self.path == "/kv/retained":
                if not server.authorized(self.headers.get("Authorization")):
                    self.send_error(401, "GET /kv/retained needs 'Authorization: Bearer <VLLM_DISAGG_AUTH_TOKEN>'")
                    return
                body, ctype = json.dumps(server.retained_info()).encode(), "application/json"
            elif self.path.startswith("/kv/checksums") and server.ingest is not None:
                if not server.authorized(self.headers.get("Authorization")):
                    self.send_error(401, "GET /kv/checksums needs 'Authorization: Bearer <VLLM_DISAGG_AUTH_TOKEN>'")
                    return
                try:
                    body, ctype = json.dumps(server.ingest.http_checksums(self.path)).encode(), "application/json"
                except ValueError as err:
                    self.send_error(400, str(err))
                    return
            elif self.path.startswith("/kv/landed") and server.ingest is not None:
                try:
                    body, ctype = json.dumps(server.ingest.http_landed(self.path)).encode(), "application/json"
                except ValueError as err:
                    self.send_error(400, str(err))
                    return
            else:
                self.send_error(404, "try /health or /metrics")
                return
            self._reply(body, ctype)

        def do_POST(self) -> None:  # noqa: N802
            if not self.path.startswith("/kv/fence") or server.ingest is None:
                self.send_error(404, "POST /kv/fence?ids=... only")
                return
            if not server.authorized(self.headers.get("Authorization")):
                self.send_error(401, "POST /kv/fence needs 'Authorization: Bearer <VLLM_DISAGG_AUTH_TOKEN>'")
                return
            try:
                body = json.dumps(server.ingest.http_fence(self.path)).encode()
            except ValueError as err:
                self.send_error(400, str(err))
                return
            self._reply(body, "application/json")

        def _reply(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args) -> None:
            logger.debug("attention http: " + fmt, *args)

    return Handler
