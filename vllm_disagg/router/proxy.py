# SPDX-License-Identifier: Apache-2.0
"""Executes routes: the P/D push path (pd_protocol.md) and whole requests on one instance.

Push path, per request: P gets `max_tokens=1` + `do_remote_decode`, D gets the client's body +
`do_remote_prefill`, both at once with one `transfer_id`; D's answer (SSE or JSON) is relayed to the
client byte for byte. P's answer is only checked for errors: when P fails, D's connector recomputes the
prompt. Nothing waits without a timeout. A refused connection before any byte reached the client is
re-routed once; a D that dies mid-stream ends the stream with an OpenAI-style error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from vllm_disagg.router import bodies
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.health import HealthChecker
from vllm_disagg.router.metrics import RouterMetrics
from vllm_disagg.router.policy import NoHealthyInstanceError
from vllm_disagg.router.pools import Instance, InstancePools, Route

logger = logging.getLogger(__name__)

# Marks a relayed response that ended badly after its 200 status went out.
_FAILED = web.ResponseKey("disagg_failed", bool)
# Errors that mean "the instance is gone or stuck": the client gets a clean 502/504 or error event.
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class _ConnectFailed(Exception):
    """The target refused the connection before the client saw anything: safe to re-route."""

    def __init__(self, instance: Instance) -> None:
        super().__init__(instance.url)
        self.instance = instance


def error_response(status: int, message: str, err_type: str = "BadGateway") -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _sse_error(message: str, status: int = 502) -> bytes:
    err = {"error": {"message": message, "type": "BadGateway", "param": None, "code": status}}
    return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


class Proxy:
    """Owns the client session to the instances and runs one request end to end."""

    def __init__(self, pools: InstancePools, health: HealthChecker, metrics: RouterMetrics,
                 config: RouterConfig) -> None:
        self.pools, self.health, self.metrics, self.config = pools, health, metrics, config
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------- entry
    async def generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """POST /v1/completions or /v1/chat/completions."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "request body is not valid JSON", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        chat = endpoint == "chat/completions"
        num_prompt = bodies.estimate_prompt_tokens(body, chat)
        num_out = bodies.expected_output_tokens(body, chat)
        allow_pd = not bodies.is_batch_prompt(body)
        start = time.monotonic()
        attempts = 2 if self.config.retry_on_connect_error else 1
        for _ in range(attempts):
            try:
                route = self.pools.route(num_prompt, num_out, allow_pd=allow_pd)
            except NoHealthyInstanceError:
                self.metrics.requests.labels(endpoint, "none", "no_instance").inc()
                return error_response(503, "no healthy vLLM instance can serve this request",
                                      "ServiceUnavailable")
            try:
                return await self._serve(request, route, body, endpoint, start)
            except _ConnectFailed as exc:
                self.health.drop(exc.instance, "refused a connection")
                self.metrics.fallbacks.labels("reroute_connect_error").inc()
            finally:
                self.pools.done(route.req_id)
        self.metrics.requests.labels(endpoint, "none", "error").inc()
        return error_response(502, "every instance tried refused the connection")

    async def forward_get(self, path: str) -> web.Response:
        """GET endpoints any instance answers the same (/v1/models)."""
        inst = self.pools.any_healthy()
        if inst is None:
            return error_response(503, "no healthy vLLM instance", "ServiceUnavailable")
        try:
            async with self.session.get(f"{inst.url}{path}") as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status, content_type=resp.content_type)
        except _UPSTREAM_ERRORS as exc:
            return error_response(502, f"instance {inst.url} failed: {exc!r}")

    # ----------------------------------------------------------- one try
    async def _serve(self, request: web.Request, route: Route, body: dict[str, Any], endpoint: str,
                     start: float) -> web.StreamResponse:
        chat = endpoint == "chat/completions"
        p_task: asyncio.Task | None = None
        if route.prefill is not None:
            pre = route.prefill
            tid = bodies.new_transfer_id()
            p_task = asyncio.create_task(self._prefill(route, bodies.prefill_body(body, tid, chat), endpoint))
            d_body = bodies.decode_body(body, tid, pre.kv_host, pre.kv_port, self.config.push_timeout_s)
        else:
            d_body = bodies.plain_body(body)
            if route.reason:
                self.metrics.fallbacks.labels(route.reason).inc()
        ok = False
        try:
            out = await self._relay(request, route, d_body, endpoint, start)
            ok = out.status == 200 and not out.get(_FAILED, False)
            return out
        finally:
            if p_task is not None and not p_task.done():
                if ok:  # P still reporting back: let it finish (bounded by prefill_timeout_s)
                    self._background.add(p_task)
                    p_task.add_done_callback(self._background.discard)
                else:  # D failed or the client left: closing P's request aborts it upstream
                    p_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await p_task

    async def _prefill(self, route: Route, p_body: dict[str, Any], endpoint: str) -> None:
        pre = route.prefill
        t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s,
                                        sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.post(f"{pre.url}/v1/{endpoint}", json=p_body, timeout=timeout) as resp:
                data = await resp.read()
                if resp.status != 200:
                    self.metrics.prefill_failures.labels(pre.url).inc()
                    logger.warning("prefill on %s failed for %s: HTTP %d %s", pre.url, route.req_id,
                                   resp.status, data[:300])
        except aiohttp.ClientConnectorError as exc:
            self.metrics.prefill_failures.labels(pre.url).inc()
            self.health.drop(pre, f"refused a connection: {exc}")
        except _UPSTREAM_ERRORS as exc:
            self.metrics.prefill_failures.labels(pre.url).inc()
            logger.warning("prefill on %s failed for %s: %r (decode recomputes)", pre.url, route.req_id, exc)
        finally:
            self.metrics.prefill_latency.observe(time.monotonic() - t0)
            self.pools.prefill_done(route.req_id)

    async def _relay(self, request: web.Request, route: Route, d_body: dict[str, Any], endpoint: str,
                     start: float) -> web.StreamResponse:
        target = route.target
        try:
            resp = await self.session.post(f"{target.url}/v1/{endpoint}", json=d_body)
        except aiohttp.ClientConnectorError as exc:
            raise _ConnectFailed(target) from exc
        except _UPSTREAM_ERRORS as exc:
            self._count(endpoint, route, "error", start)
            return error_response(502, f"instance {target.url} failed before answering: {exc!r}")
        try:
            headers = {"x-disagg-route": route.kind, "x-disagg-decode": target.url}
            if route.prefill is not None:
                headers["x-disagg-prefill"] = route.prefill.url
            if resp.status == 200 and resp.content_type == "text/event-stream":
                return await self._relay_stream(request, route, resp, headers, endpoint, start)
            try:
                data = await resp.read()
            except _UPSTREAM_ERRORS as exc:
                self._count(endpoint, route, "error", start)
                self.health.record(target, False)
                return error_response(502, f"instance {target.url} failed mid-response: {exc!r}")
            self.metrics.ttft.labels(route.kind).observe(time.monotonic() - start)
            self._count(endpoint, route, "ok" if resp.status == 200 else f"http_{resp.status}", start)
            return web.Response(body=data, status=resp.status, headers=headers,
                                content_type=resp.content_type or "application/json")
        finally:
            resp.close()

    async def _relay_stream(self, request: web.Request, route: Route, resp: aiohttp.ClientResponse,
                            headers: dict[str, str], endpoint: str, start: float) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={**headers, "Cache-Control": "no-cache"})
        out.content_type = "text/event-stream"
        await out.prepare(request)
        first = True
        while True:
            try:
                chunk = await resp.content.readany()
            except _UPSTREAM_ERRORS as exc:
                return await self._end_stream_with_error(out, route, endpoint, start, exc)
            if not chunk:
                break
            if first:
                self.metrics.ttft.labels(route.kind).observe(time.monotonic() - start)
                first = False
            self.pools.decode_progress(route.req_id, chunk.count(b"data: "))
            try:
                await out.write(chunk)
            except (ConnectionError, RuntimeError):
                # the client went away; closing `resp` aborts the request upstream
                self._count(endpoint, route, "client_gone", start)
                out[_FAILED] = True
                return out
        self._count(endpoint, route, "ok", start)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write_eof()
        return out

    async def _end_stream_with_error(self, out: web.StreamResponse, route: Route, endpoint: str,
                                     start: float, exc: BaseException) -> web.StreamResponse:
        logger.error("decode instance %s failed mid-stream for %s: %r", route.target.url, route.req_id, exc)
        self.health.record(route.target, False)
        self._count(endpoint, route, "error", start)
        out[_FAILED] = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await out.write(_sse_error(f"instance {route.target.url} failed mid-stream: {exc!r}"))
            await out.write_eof()
        return out

    def _count(self, endpoint: str, route: Route, outcome: str, start: float) -> None:
        self.metrics.requests.labels(endpoint, route.kind, outcome).inc()
        self.metrics.latency.labels(route.kind).observe(time.monotonic() - start)
