# SPDX-License-Identifier: Apache-2.0
"""Relaying the non-P/D routes of `api.py`: one instance, every instance, or the one holding a response.

A relayed request keeps its method, path, query, body and end-to-end headers (Authorization,
X-Request-Id, traceparent, ...); the answer keeps its status, content type and body, streamed as it
arrives (SSE generation, audio). Errors of the instance itself (4xx/5xx) reach the client as they are;
only a dead or silent instance becomes the router's 502 (after a re-route for `WHOLE` requests that
found the instance refusing connections).
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

from vllm_disagg.router import api, bodies
from vllm_disagg.router.pools import Instance

logger = logging.getLogger(__name__)

_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade", "te",
               "proxy-authorization", "proxy-connection", "accept-encoding"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def not_found(known_path: bool) -> web.Response:
    """FastAPI's answer to an unknown path (404) or a known path with another method (405)."""
    if known_path:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)
    return web.json_response({"detail": "Not Found"}, status=404)


def _error(status: int, message: str, err_type: str = "BadGateway") -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


def upstream_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}


class Forwarder:
    """Runs the `WHOLE`, `STATELESS`, `ADMIN` and `STATEFUL` classes on the proxy's client session."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.responses = api.ResponseStore()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self.router.proxy.session

    async def handle(self, request: web.Request, cls: api.RouteClass) -> web.StreamResponse:
        body = await request.read()
        if cls is api.RouteClass.STATELESS:
            return await self.stateless(request, body)
        if cls is api.RouteClass.ADMIN:
            return await self.fan_out(request, body)
        if cls is api.RouteClass.STATEFUL:
            inst = self._instance(self.responses.instance_of(api.response_id_of(request.path)))
            return await self.stateless(request, body, inst)
        return await self.whole(request, body)

    # ------------------------------------------------------------ one instance
    async def stateless(self, request: web.Request, body: bytes, inst: Instance | None = None) -> web.StreamResponse:
        inst = inst or self.router.pools.any_healthy()
        if inst is None:
            return _error(503, "no healthy vLLM instance", "ServiceUnavailable")
        try:
            return await self.relay(request, inst, body)
        except _UPSTREAM_ERRORS as exc:
            return _error(502, f"instance {inst.url} failed: {exc!r}")

    async def whole(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Generation or pooling on one instance the policy picks, re-routed once on a refused connection."""
        parsed = _json_object(body)
        pinned = self._instance(self.responses.instance_of(parsed.get("previous_response_id")))
        proxy, metrics = self.router.proxy, self.router.metrics
        num_prompt, num_out = _estimates(parsed)
        for attempt in range(2):
            if pinned is not None:
                target, req_id = pinned, None
            else:
                route, why = await proxy.route_when_ready(request, lambda: (num_prompt, num_out), False,
                                                          self.router.config.admission_wait_s if attempt == 0 else 0)
                if route is None:
                    return proxy.no_route_response(request.path, why)
                target, req_id = route.target, route.req_id
                metrics.fallbacks.labels("endpoint").inc()
            start = time.monotonic()
            try:
                out = await self.relay(request, target, body, remember=request.path == "/v1/responses")
                metrics.requests.labels(request.path, "plain", "ok" if out.status < 400 else f"http_{out.status}").inc()
                metrics.latency.labels("plain").observe(time.monotonic() - start)
                return out
            except aiohttp.ClientConnectorError:
                self.router.health.drop(target, "refused a connection")
                if pinned is not None:
                    break
            except _UPSTREAM_ERRORS as exc:
                metrics.requests.labels(request.path, "plain", "error").inc()
                return _error(502, f"instance {target.url} failed: {exc!r}")
            finally:
                if req_id is not None:
                    self.router.pools.done(req_id)
        metrics.requests.labels(request.path, "plain", "error").inc()
        return _error(502, "every instance tried refused the connection")

    async def relay(self, request: web.Request, inst: Instance, body: bytes,
                    remember: bool = False) -> web.StreamResponse:
        """Send the request to `inst` and stream its answer back unchanged."""
        url = f"{inst.url}{request.rel_url}"
        async with self.session.request(request.method, url, data=body or None,
                                        headers=upstream_headers(request)) as resp:
            headers = {"x-disagg-instance": inst.url}
            if resp.content_type != "text/event-stream":
                data = await resp.read()
                if remember and resp.status == 200:
                    self._remember(data, inst)
                return web.Response(body=data, status=resp.status, headers=headers,
                                    content_type=resp.content_type or "application/json")
            out = web.StreamResponse(status=resp.status, headers={**headers, "Cache-Control": "no-cache"})
            out.content_type = resp.content_type
            await out.prepare(request)
            first = True
            async for chunk in resp.content.iter_any():
                if remember and first:
                    self._remember_stream(chunk, inst)
                    first = False
                try:
                    await out.write(chunk)
                except (ConnectionError, RuntimeError):
                    return out  # the client left; leaving the block closes the upstream request
            with contextlib.suppress(ConnectionError, RuntimeError):
                await out.write_eof()
            return out

    # ------------------------------------------------------------ every instance
    async def fan_out(self, request: web.Request, body: bytes) -> web.Response:
        targets = self.router.pools.healthy_instances()
        if not targets:
            return _error(503, "no healthy vLLM instance", "ServiceUnavailable")
        results = await asyncio.gather(*(self._one(request, inst, body) for inst in targets))
        statuses = {status for status, _, _ in results}
        if len(statuses) == 1:
            status, data, ctype = results[0]
            return web.Response(body=data, status=status, content_type=ctype,
                                headers={"x-disagg-instances": str(len(targets))})
        detail = ", ".join(f"{inst.url}: {status}" for inst, (status, _, _) in zip(targets, results, strict=True))
        logger.warning("%s %s answered differently per instance: %s", request.method, request.path, detail)
        return _error(502, f"instances answered {request.method} {request.path} differently: {detail}")

    async def _one(self, request: web.Request, inst: Instance, body: bytes) -> tuple[int, bytes, str]:
        try:
            async with self.session.request(request.method, f"{inst.url}{request.rel_url}", data=body or None,
                                            headers=upstream_headers(request)) as resp:
                return resp.status, await resp.read(), resp.content_type or "application/json"
        except _UPSTREAM_ERRORS as exc:
            return 502, json.dumps({"error": {"message": f"{inst.url} failed: {exc!r}"}}).encode(), "application/json"

    # ------------------------------------------------------------ responses
    def _instance(self, instance_id: str | None) -> Instance | None:
        return self.router.pools.instances.get(instance_id) if instance_id else None

    def _remember(self, data: bytes, inst: Instance) -> None:
        rid = _json_object(data).get("id")
        if isinstance(rid, str):
            self.responses.remember(rid, inst.instance_id)

    def _remember_stream(self, chunk: bytes, inst: Instance) -> None:
        """A streamed response's id is in its first event (`response.created`)."""
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: "):
                rid = (_json_object(line[6:]).get("response") or {}).get("id")
                if isinstance(rid, str):
                    self.responses.remember(rid, inst.instance_id)
                    return


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data) if data else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _estimates(body: dict[str, Any]) -> tuple[int, int]:
    """Token estimates for JSQ from whichever prompt field the body has (messages, prompt, input)."""
    if "messages" in body:
        num_prompt = bodies.estimate_prompt_tokens(body, chat=True)
    else:
        num_prompt = bodies.estimate_prompt_tokens({"prompt": body.get("prompt", body.get("input", ""))}, chat=False)
    limit = body.get("max_tokens") or body.get("max_output_tokens") or body.get("max_completion_tokens") or 1
    return num_prompt, max(1, int(limit) if isinstance(limit, (int, float)) else 1)


__all__ = ["Forwarder", "not_found", "upstream_headers"]
