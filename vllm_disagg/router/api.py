# SPDX-License-Identifier: Apache-2.0
"""The router's API surface: every route plain `vllm serve` offers, handled by its class.

- `PD`: /v1/completions and /v1/chat/completions go through the P/D push path (proxy.py).
- `WHOLE`: other generation and pooling work runs whole on one instance the policy picks (JSQ; decode
  pool first): these bodies carry no push protocol, so they take no P/D route.
- `STATELESS`: any healthy instance answers the same (/tokenize, /v1/models, /version, docs, ...).
- `ADMIN`: fanned out to every healthy instance; their common status and the first body, else 502.
- `STATEFUL`: the instance that created the response (`ResponseStore`); an unknown id: any instance.
- `LOCAL`: the router's own /health, /ping, /metrics.
Each class's routes and answers: README.md, "API surface". Paths no class knows get FastAPI's
`{"detail": "Not Found"}` (404) or 405, as plain vLLM answers.
"""

from __future__ import annotations

import enum
import re
from collections import OrderedDict


class RouteClass(str, enum.Enum):
    PD = "pd"
    WHOLE = "whole"
    STATELESS = "stateless"
    ADMIN = "admin"
    STATEFUL = "stateful"
    LOCAL = "local"


_C = RouteClass
# (method, path) -> class: plain vLLM 0.32's routes for every task and server flag (dev mode, LoRA
# updating, profiler, elastic EP, weight transfer); tests/unit/router/test_api_surface.py checks this
# table against vLLM's own app.
ROUTES: dict[tuple[str, str], RouteClass] = {
    ("POST", "/v1/completions"): _C.PD,
    ("POST", "/v1/chat/completions"): _C.PD,
    **{("POST", p): _C.WHOLE for p in (
        "/v1/messages", "/v1/responses", "/v1/chat/completions/batch", "/inference/v1/generate",
        "/generative_scoring", "/v1/systemone", "/invocations", "/cohere/v2/chat", "/v1/audio/transcriptions",
        "/v1/audio/translations", "/pooling", "/classify", "/score", "/rerank", "/v1/embeddings", "/v1/score",
        "/v1/rerank", "/v2/embed", "/v2/rerank")},
    **{("POST", p): _C.STATELESS for p in (
        "/tokenize", "/detokenize", "/v1/messages/count_tokens", "/v1/completions/render",
        "/v1/chat/completions/render", "/v1/messages/render", "/v1/responses/render",
        "/v1/completions/derender", "/v1/chat/completions/derender")},
    **{("GET", p): _C.STATELESS for p in (
        "/v1/models", "/version", "/load", "/server_info", "/tokenizer_info", "/kv_event_sources", "/openapi.json",
        "/docs", "/docs/oauth2-redirect", "/redoc", "/get_world_size", "/weight_info", "/fault_tolerance/status")},
    **{("POST", p): _C.ADMIN for p in (
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/sleep", "/wake_up", "/pause", "/resume",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/adapters", "/collective_rpc", "/update_weights",
        "/start_weight_update", "/finish_weight_update", "/start_draft_weight_update", "/update_weight_version",
        "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/release_kv_cache_memory",
        "/abort_requests", "/inference/v1/abort_requests", "/start_profile", "/stop_profile", "/scale_elastic_ep",
        "/is_scaling_elastic_ep", "/fault_tolerance/apply", "/weight_checker")},
    ("GET", "/is_sleeping"): _C.ADMIN,
    ("GET", "/is_paused"): _C.ADMIN,
    ("DELETE", "/adapters/{adapter_name}"): _C.ADMIN,
    ("GET", "/v1/responses/{response_id}"): _C.STATEFUL,
    ("POST", "/v1/responses/{response_id}/cancel"): _C.STATEFUL,
    ("GET", "/health"): _C.LOCAL,
    ("GET", "/ping"): _C.LOCAL,
    ("POST", "/ping"): _C.LOCAL,
    ("GET", "/metrics"): _C.LOCAL,
}
_PATTERNS = [(m, re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", p) + "$"), p, c) for (m, p), c in ROUTES.items()]


def classify(method: str, path: str) -> tuple[RouteClass | None, bool]:
    """(class, path_known): the class of `method path`, and whether the path exists for another method."""
    method = "GET" if method == "HEAD" else method
    known = False
    for m, rx, _, cls in _PATTERNS:
        if rx.match(path):
            if m == method:
                return cls, True
            known = True
    return None, known


class ResponseStore:
    """Which instance created each stored response (`/v1/responses` answers' ids), newest kept."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._where: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, instance_id: str) -> None:
        self._where[response_id] = instance_id
        self._where.move_to_end(response_id)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def instance_of(self, response_id: str | None) -> str | None:
        return self._where.get(response_id) if response_id else None


def response_id_of(path: str) -> str | None:
    """The `{response_id}` of /v1/responses/{response_id}[/cancel]."""
    parts = path.strip("/").split("/")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["v1", "responses"] else None
