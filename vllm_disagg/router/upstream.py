# SPDX-License-Identifier: Apache-2.0
"""What the proxy and the replay run share about answering through an instance: the errors that
mean it is gone or stuck, OpenAI-style error bodies and events, the route headers, and the wait for
an answer's headers that a cut can end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
from aiohttp import web

from vllm_disagg.router.pools import Route

# Marks a relayed response that ended badly after its 200 status went out.
FAILED = web.ResponseKey("disagg_failed", bool)
# Errors that mean "the instance is gone or stuck": the client gets a clean 502/504 or error event.
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def error_response(status: int, message: str, err_type: str = "BadGateway",
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def sse_error(message: str, status: int = 502) -> bytes:
    err = {"error": {"message": message, "type": "BadGateway", "param": None, "code": status}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def route_headers(route: Route) -> dict[str, str]:
    headers = {"x-disagg-route": route.kind, "x-disagg-decode": route.target.url}
    if route.prefill is not None:
        headers["x-disagg-prefill"] = route.prefill.url
    return headers


async def await_headers(post: asyncio.Future, was_cut: Callable[[], bool]) -> aiohttp.ClientResponse | None:
    """The answer of a POST that runs as a task, so that a cut (its instance left routing) can cancel the
    wait for the headers (a hung instance sends none): None when the cut ended it."""
    try:
        return await post
    except asyncio.CancelledError:
        if not was_cut() or asyncio.current_task().cancelling():
            raise  # not our cut: the handler itself is being cancelled
        return None


def client_gone(request: web.Request) -> bool:
    """The client closed its connection (aiohttp drops the transport when it notices)."""
    transport = request.transport
    return transport is None or transport.is_closing()
