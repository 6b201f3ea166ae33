# SPDX-License-Identifier: Apache-2.0
"""`Relay`: one attempt of a request that cannot be replayed, relayed byte for byte.

Batch prompts, n > 1 and echo have no continuation (replay.py), so the answer goes to the client as
the instance sends it. An attempt whose instance leaves routing is cut at once (a hung instance
answers nothing: without the cut the request would wait out `read_timeout_s`); when the client has
seen nothing yet that is `ConnectFailed`, and the proxy re-routes the request once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from vllm_disagg.router.pools import Instance, Route
from vllm_disagg.router.upstream import (
    FAILED,
    UPSTREAM_ERRORS,
    await_headers,
    error_response,
    route_headers,
    sse_error,
)

if TYPE_CHECKING:
    from vllm_disagg.router.proxy import Proxy

logger = logging.getLogger(__name__)


class ConnectFailed(Exception):
    """The target refused the connection, or was cut (left routing), before the client saw anything:
    safe to re-route."""

    def __init__(self, instance: Instance, why: str = "refused a connection") -> None:
        super().__init__(f"{instance.url}: {why}")
        self.instance, self.why = instance, why


class Relay:
    """One not-replayable attempt, so that `cut` can end it when its instance leaves routing."""

    def __init__(self, proxy: Proxy, route: Route) -> None:
        self.p, self.route = proxy, route
        self.post: asyncio.Task | None = None
        self.resp: aiohttp.ClientResponse | None = None
        self.cut_from: str | None = None
        self.sent = False  # bytes of it reached the client

    def cut(self, instance_id: str) -> None:
        route = self.route
        prefill_left = route.prefill is not None and route.prefill.instance_id == instance_id and not self.sent
        if self.cut_from is not None or (route.target.instance_id != instance_id and not prefill_left):
            return
        self.cut_from = instance_id
        logger.warning("cutting a request off %s: %s left routing", route.target.url,
                       "it" if not prefill_left else f"its prefill instance {route.prefill.url}")
        if self.resp is not None:
            self.resp.content.set_exception(ConnectionResetError(
                f"instance {route.target.url} left routing (failed health checks, or no progress for "
                "--stall-timeout-s); this request (batch prompt, n > 1 or echo) cannot be continued elsewhere"))
        elif self.post is not None:
            self.post.cancel()

    async def run(self, request: web.Request, d_body: dict[str, Any], endpoint: str,
                  start: float) -> web.StreamResponse:
        """Send the target its body and relay its answer; `ConnectFailed` if another instance may answer."""
        route, target = self.route, self.route.target
        self.post = asyncio.ensure_future(self.p.session.post(f"{target.url}/v1/{endpoint}", json=d_body))
        try:
            resp = await await_headers(self.post, lambda: self.cut_from is not None)
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(target) from exc
        except UPSTREAM_ERRORS as exc:
            self.p.count(endpoint, route, "error", start)
            return error_response(502, f"instance {target.url} failed before answering: {exc!r}")
        if resp is None:
            raise ConnectFailed(target, "left routing before it answered")
        self.resp = resp
        try:
            if self.cut_from is not None:
                raise ConnectFailed(target, "left routing before it answered")
            headers = route_headers(route)
            if resp.status == 200 and resp.content_type == "text/event-stream":
                return await self._stream(request, resp, headers, endpoint, start)
            try:
                data = await resp.read()
            except UPSTREAM_ERRORS as exc:
                if self.cut_from is not None:  # nothing reached the client: another instance answers it
                    raise ConnectFailed(target, "left routing before it answered") from exc
                self.p.count(endpoint, route, "error", start)
                self.p.health.record(target, False)
                return error_response(502, f"instance {target.url} failed mid-response: {exc!r}")
            self.p.metrics.ttft.labels(route.kind).observe(time.monotonic() - start)
            self.p.count(endpoint, route, "ok" if resp.status == 200 else f"http_{resp.status}", start)
            return web.Response(body=data, status=resp.status, headers=headers,
                                content_type=resp.content_type or "application/json")
        finally:
            resp.close()

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse, headers: dict[str, str],
                      endpoint: str, start: float) -> web.StreamResponse:
        route = self.route
        out = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
        out.content_type = "text/event-stream"
        await out.prepare(request)
        self.sent = True
        first = True
        while True:
            try:
                chunk = await resp.content.readany()
            except UPSTREAM_ERRORS as exc:
                return await self._end_stream_with_error(out, endpoint, start, exc)
            if not chunk:
                break
            if first:
                self.p.metrics.ttft.labels(route.kind).observe(time.monotonic() - start)
                first = False
            route.target.last_progress = time.monotonic()  # the stall watchdog's evidence
            self.p.pools.decode_progress(route.req_id, chunk.count(b"data: "))
            try:
                await out.write(chunk)
            except (ConnectionError, RuntimeError):
                # the client went away; closing `resp` aborts the request upstream
                self.p.count(endpoint, route, "client_gone", start)
                out[FAILED] = True
                return out
        self.p.count(endpoint, route, "ok", start)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write_eof()
        return out

    async def _end_stream_with_error(self, out: web.StreamResponse, endpoint: str, start: float,
                                     exc: BaseException) -> web.StreamResponse:
        route = self.route
        logger.error("decode instance %s failed mid-stream for %s: %r", route.target.url, route.req_id, exc)
        self.p.health.record(route.target, False)
        self.p.count(endpoint, route, "error", start)
        out[FAILED] = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(sse_error(f"instance {route.target.url} failed mid-stream: {exc!r}"))
            await out.write_eof()
        return out
