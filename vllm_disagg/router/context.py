# SPDX-License-Identifier: Apache-2.0
"""Per-request headers every upstream call of a client request carries: X-Request-Id, the client's
Authorization (instances started with the same `--api-key` accept it), and W3C `traceparent` naming
the router span the call belongs to.

They are set once per client request (`bind`) in a context variable; an aiohttp `TraceConfig` on the
proxy's session adds them to each request it sends (P's and D's halves, replays, relays), so no call
site passes headers by hand. Tasks started for the request (P's half) inherit the context.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Mapping

import aiohttp

from vllm_disagg.observe import tracing

_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("disagg_upstream_headers",
                                                                                  default=None)
_SPAN: contextvars.ContextVar[object | None] = contextvars.ContextVar("disagg_upstream_span", default=None)


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id (kept, as vLLM keeps it), else a new one."""
    rid = headers.get("X-Request-Id", "").strip()
    return rid[:256] if rid else uuid.uuid4().hex


def bind(request_id: str, authorization: str | None) -> None:
    """Headers for every upstream call made from the current context on."""
    headers = {"X-Request-Id": request_id}
    if authorization:
        headers["Authorization"] = authorization
    _HEADERS.set(headers)


def set_span(span: object | None) -> contextvars.Token:
    """The span upstream calls made from the current context are children of (until reset)."""
    return _SPAN.set(span)


def reset_span(token: contextvars.Token) -> None:
    _SPAN.reset(token)


def current_span():
    """The span upstream calls from this context belong to (None when the request is not traced)."""
    return _SPAN.get()


def current() -> dict[str, str]:
    """This context's upstream headers, with the current span's `traceparent`."""
    headers = dict(_HEADERS.get() or {})
    span = _SPAN.get()
    if span is not None:
        headers.update(tracing.headers_for(span))
    return headers


async def _on_request_start(_session, _ctx, params: aiohttp.TraceRequestStartParams) -> None:
    for key, value in current().items():
        if key not in params.headers:
            params.headers[key] = value


def trace_config() -> aiohttp.TraceConfig:
    """Attach to the proxy's ClientSession (`trace_configs=[...]`)."""
    config = aiohttp.TraceConfig()
    config.on_request_start.append(_on_request_start)
    return config
