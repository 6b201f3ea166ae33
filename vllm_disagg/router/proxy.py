# SPDX-License-Identifier: Apache-2.0
"""Executes routes: the P/D push path (pd_protocol.md) and whole requests on one instance.

Push path, per request: P gets `max_tokens=1` + `do_remote_decode`, D gets the client's body +
`do_remote_prefill`, both at once with one `transfer_id`; D's answer (SSE or JSON) is relayed to the
client byte for byte. P's answer is only checked for errors: when P fails, D's connector recomputes the
prompt. Nothing waits without a timeout.

Single-prompt requests are replayed (`replay_attempts`, router/replay.py): when the instance refuses,
answers 5xx, or dies before its last token, the request goes again to a healthy instance (the same
one once it is back, or another one), as a continuation of the tokens the client already has, and
the client sees one uninterrupted answer. Other requests (batch prompts, n > 1, echo) keep the old
behaviour: a refused connection is re-routed once, and a death mid-stream ends the stream with an
OpenAI-style error event.

Admission: a new request that finds no healthy instance (the only one is restarting) waits up to
`admission_wait_s` for one to join or pass a health check, woken by the scheduler's membership
callback (no polling of the pools), then proceeds; after that it gets 503. A client that leaves
while it waits is noticed within a second and nothing is sent upstream.

A replayable attempt whose instance leaves routing (failed health checks, discovery removed it, or
another request saw it die) is cut at once and replayed, instead of waiting out `read_timeout_s` on
an instance that is hung rather than dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram

from vllm_disagg.router import bodies, replay
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


# Attempt failures that mean the instance is gone: it leaves routing until a health poll restores it.
_INSTANCE_GONE = ("connect", "no_answer", "mid_stream", "mid_response")
# How often a waiting request checks that its client is still connected (aiohttp has no event for it).
_CLIENT_CHECK_S = 1.0
_WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class _AttemptFailed(Exception):
    """One replayable attempt failed in a way that a re-send can fix."""

    def __init__(self, reason: str, instance: Instance, detail: str) -> None:
        super().__init__(f"{reason} on {instance.url}: {detail}")
        self.reason, self.instance = reason, instance


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
        self._max_model_len: dict[str, int] = {}
        self.replays = Counter(
            "vllm:disagg_router_replays", "Re-sent attempts of requests whose instance failed, by cause.",
            ["endpoint", "reason"], registry=metrics.registry,
        )
        self.admission_waits = Histogram(
            "vllm:disagg_router_admission_wait_seconds",
            "Waits of new requests that found no healthy instance, by how they ended "
            "(admitted, timed_out, client_gone).", ["outcome"], buckets=_WAIT_BUCKETS, registry=metrics.registry,
        )
        self._joined = asyncio.Event()  # replaced after each set: waiters hold the one they saw
        self._cuts: dict[str, Callable[[str], None]] = {}  # req_id -> cut its attempt (instance left)
        pools.scheduler.listeners.append(self._on_membership)

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
        start = time.monotonic()
        if self.config.replay_attempts and replay.replayable(body):
            return await ReplayRun(self, request, body, endpoint, start).run()
        num_prompt = bodies.estimate_prompt_tokens(body, chat)
        num_out = bodies.expected_output_tokens(body, chat)
        allow_pd = not bodies.is_batch_prompt(body)
        attempts = 2 if self.config.retry_on_connect_error else 1
        for attempt in range(attempts):
            route, why = await self.route_when_ready(
                request, lambda: (num_prompt, num_out), allow_pd,
                self.config.admission_wait_s if attempt == 0 else 0.0)
            if route is None:
                return self.no_route_response(endpoint, why)
            try:
                return await self._serve(request, route, body, endpoint, start)
            except _ConnectFailed as exc:
                self.health.drop(exc.instance, "refused a connection")
                self.metrics.fallbacks.labels("reroute_connect_error").inc()
            finally:
                self.pools.done(route.req_id)
        self.metrics.requests.labels(endpoint, "none", "error").inc()
        return error_response(502, "every instance tried refused the connection")

    # --------------------------------------------------------- admission
    def _on_membership(self, instance_id: str, healthy: bool, lost: list[str]) -> None:
        """Scheduler callback: wake waiting requests on a join; cut attempts on an instance that left."""
        if healthy:
            self._joined.set()
            self._joined = asyncio.Event()
            return
        for req_id in lost:
            cut = self._cuts.get(req_id)
            if cut is not None:
                cut(instance_id)

    async def route_when_ready(self, request: web.Request, estimates: Callable[[], tuple[int, int]],
                               allow_pd: bool, wait_s: float,
                               tick: Callable[[], Awaitable[bool]] | None = None,
                               admission: bool = True) -> tuple[Route | None, str]:
        """A route, waiting up to `wait_s` for a healthy instance; (None, why) when none came.

        `why` is "timed_out" or "client_gone". `tick` runs about once a second while waiting (a
        started stream's keep-alive); False from it ends the wait as "client_gone". Waits of new
        requests (`admission`) go into the admission histogram; a replay's wait does not."""
        try:
            return self.pools.route(*estimates(), allow_pd=allow_pd), "admitted"
        except NoHealthyInstanceError:
            if wait_s <= 0:
                return None, "timed_out"
        t0 = time.monotonic()
        deadline = t0 + wait_s
        logger.debug("no healthy instance for a request: waiting up to %.0f s for one", wait_s)
        while True:
            joined = self._joined
            left = deadline - time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(joined.wait(), timeout=max(0.0, min(left, _CLIENT_CHECK_S)))
            gone = _client_gone(request) or (tick is not None and not await tick())
            route = why = None
            if gone:
                why = "client_gone"
            else:
                try:
                    route, why = self.pools.route(*estimates(), allow_pd=allow_pd), "admitted"
                except NoHealthyInstanceError:
                    if time.monotonic() >= deadline:
                        why = "timed_out"
            if why is not None:
                if admission:
                    self.admission_waits.labels(why).observe(time.monotonic() - t0)
                return route, why

    def no_route_response(self, endpoint: str, why: str) -> web.Response:
        """503 for a request no instance took (after the admission wait)."""
        self.metrics.requests.labels(endpoint, "none", "client_gone" if why == "client_gone" else "no_instance").inc()
        return error_response(503, "no healthy vLLM instance can serve this request", "ServiceUnavailable")

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
        p_task, d_body = self.start_prefill(route, body, endpoint)
        ok = False
        try:
            out = await self._relay(request, route, d_body, endpoint, start)
            ok = out.status == 200 and not out.get(_FAILED, False)
            return out
        finally:
            await self.end_prefill(p_task, ok)

    def start_prefill(self, route: Route, body: dict[str, Any],
                      endpoint: str) -> tuple[asyncio.Task | None, dict[str, Any]]:
        """Send P its half now (push path) and return it with D's body; plain routes get the body as is."""
        if route.prefill is None:
            if route.reason:
                self.metrics.fallbacks.labels(route.reason).inc()
            return None, bodies.plain_body(body)
        pre = route.prefill
        tid = bodies.new_transfer_id()
        chat = endpoint == "chat/completions"
        p_task = asyncio.create_task(self._prefill(route, bodies.prefill_body(body, tid, chat), endpoint))
        return p_task, bodies.decode_body(body, tid, pre.kv_host, pre.kv_port, self.config.push_timeout_s)

    async def end_prefill(self, p_task: asyncio.Task | None, ok: bool) -> None:
        if p_task is None or p_task.done():
            return
        if ok:  # P still reporting back: let it finish (bounded by prefill_timeout_s)
            self._background.add(p_task)
            p_task.add_done_callback(self._background.discard)
        else:  # D failed or the client left: closing P's request aborts it upstream
            p_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await p_task

    async def max_model_len(self, inst: Instance) -> int | None:
        """The instance's context length (from /v1/models), for chat continuations without max_tokens."""
        if inst.url not in self._max_model_len:
            try:
                async with self.session.get(f"{inst.url}/v1/models") as resp:
                    self._max_model_len[inst.url] = int((await resp.json())["data"][0]["max_model_len"])
            except (*_UPSTREAM_ERRORS, KeyError, IndexError, TypeError, ValueError) as exc:
                logger.warning("no max_model_len from %s: %r", inst.url, exc)
                return None
        return self._max_model_len[inst.url]

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


class ReplayRun:
    """One replayable request: attempts until one ends the answer, the client leaves, or the budget is spent.

    An attempt whose instance is gone drops it from routing (the health checker restores it once it
    answers again); one that answered 5xx or an error event stays routable. The first attempt waits up
    to `admission_wait_s` for a healthy instance, a replay up to `replay_wait_s`. A stream that already
    started stays open meanwhile (SSE comments every few seconds keep idle clients patient). An attempt
    whose instance leaves routing meanwhile is cut (`_cut`) and replayed at once."""

    _KEEPALIVE_S = 5.0

    def __init__(self, proxy: Proxy, request: web.Request, body: dict[str, Any], endpoint: str,
                 start: float) -> None:
        self.p, self.request, self.body, self.endpoint, self.start = proxy, request, body, endpoint, start
        self.chat = endpoint == "chat/completions"
        self.stitch = replay.Stitcher(body, self.chat) if body.get("stream") else None
        self.out: web.StreamResponse | None = None
        self._first = True
        self._cut_from: str | None = None  # the instance the current attempt was cut from
        self._cut_exc: ConnectionResetError | None = None  # what the cut made its response read raise
        self._target: Instance | None = None  # the current attempt's instance
        self._post: asyncio.Task | None = None  # the current attempt's request, until its headers came
        self._resp: aiohttp.ClientResponse | None = None  # ... and its response after that
        self._next_ping = 0.0

    async def run(self) -> web.StreamResponse:
        last: _AttemptFailed | None = None
        route: Route | None = None
        for attempt in range(1 + self.p.config.replay_attempts):
            if attempt:
                self.p.replays.labels(self.endpoint, last.reason).inc()
                logger.warning("replaying a %s request (attempt %d, %d tokens already sent): %s", self.endpoint,
                               attempt + 1, len(self.stitch.generated) if self.stitch else 0, last)
            if self.stitch is not None and not self.stitch.continuable():
                break
            if self.stitch is not None and self.stitch.spent():
                return await self._close_with(self.stitch.finish_chunk(), route)
            wait_s = self.p.config.replay_wait_s if attempt else self.p.config.admission_wait_s
            route, why = await self.p.route_when_ready(self.request, self._estimates, True, wait_s,
                                                       self._keepalive, admission=not attempt)
            if route is None:
                if attempt == 0:
                    return self.p.no_route_response(self.endpoint, why)
                break
            self.p._cuts[route.req_id] = self._cut
            try:
                return await self._attempt(route)
            except _AttemptFailed as exc:
                last = exc
                if self._cut_exc is not None and exc.__cause__ is self._cut_exc:  # failed by our cut, not on its own
                    last = exc = _AttemptFailed("left_routing", exc.instance, "left routing mid-answer")
                if exc.reason in _INSTANCE_GONE:  # one that still answers (5xx, error event) stays routable
                    self.p.health.drop(exc.instance, str(exc))
            finally:
                self.p._cuts.pop(route.req_id, None)
                self._cut_from = self._cut_exc = self._target = self._post = self._resp = None
                self.p.pools.done(route.req_id)
        return await self._give_up(last, route)

    # ----------------------------------------------------------- routing
    def _estimates(self) -> tuple[int, int]:
        st = self.stitch
        if st is not None and st.prompt_ids is not None and st.generated:
            return len(st.prompt_ids) + len(st.generated), max(1, st.remaining() or 1)
        return (bodies.estimate_prompt_tokens(self.body, self.chat),
                bodies.expected_output_tokens(self.body, self.chat))

    async def _keepalive(self) -> bool:
        """While waiting: an SSE comment every few seconds on a started stream; False if the client left."""
        if self.out is None or time.monotonic() < self._next_ping:
            return True
        self._next_ping = time.monotonic() + self._KEEPALIVE_S
        return await self._write(b": waiting for a healthy instance to replay on\n\n")

    def _cut(self, instance_id: str) -> None:
        """The current attempt's instance left routing: fail the attempt now (it is replayed)."""
        route_target = self._target
        if route_target is None or route_target.instance_id != instance_id or self._cut_from is not None:
            return  # e.g. only its prefill instance left: D recomputes the prompt, the attempt goes on
        self._cut_from = instance_id
        logger.warning("cutting a %s request off %s: it left routing", self.endpoint, route_target.url)
        if self._resp is not None:  # an attempt that already failed on its own keeps its own reason
            self._cut_exc = ConnectionResetError(f"{route_target.url} left routing")
            self._resp.content.set_exception(self._cut_exc)
        elif self._post is not None:
            self._post.cancel()

    # ----------------------------------------------------------- attempt
    async def _attempt(self, route: Route) -> web.StreamResponse:
        body, endpoint = self.body, self.endpoint
        if self.stitch is not None:
            mml = await self.p.max_model_len(route.target) if self.stitch.needs_max_model_len() else None
            if self.stitch.needs_max_model_len() and mml is None:
                raise _AttemptFailed("no_answer", route.target, "no max_model_len for the continuation")
            body, endpoint = self.stitch.next_request(self.endpoint, mml)
        p_task, d_body = self.p.start_prefill(route, body, endpoint)
        ok = False
        try:
            out = await self._relay(route, d_body, endpoint)
            ok = True
            return out
        finally:
            await self.p.end_prefill(p_task, ok)

    async def _relay(self, route: Route, d_body: dict[str, Any], endpoint: str) -> web.StreamResponse:
        target = self._target = route.target
        # A task, so that `_cut` can end the wait for the headers (a hung instance sends none).
        self._post = asyncio.ensure_future(self.p.session.post(f"{target.url}/v1/{endpoint}", json=d_body))
        try:
            resp = await self._post
        except asyncio.CancelledError:
            if self._cut_from is None or asyncio.current_task().cancelling():
                raise  # not our cut: the handler itself is being cancelled
            raise _AttemptFailed("left_routing", target, "left routing before it answered") from None
        except _UPSTREAM_ERRORS as exc:
            reason = "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "no_answer"
            raise _AttemptFailed(reason, target, repr(exc)) from exc
        self._resp = resp
        if self._cut_from is not None:  # cut between the headers and here
            resp.close()
            raise _AttemptFailed("left_routing", target, "left routing before it answered")
        try:
            if resp.status >= 500:
                raise _AttemptFailed("http_5xx", target, f"HTTP {resp.status} {(await _read(resp, target))[:300]!r}")
            if resp.status == 200 and self.stitch is not None and resp.content_type == "text/event-stream":
                return await self._relay_stream(route, resp)
            return await self._relay_whole(route, resp)
        finally:
            resp.close()

    async def _relay_whole(self, route: Route, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        data = await _read(resp, route.target)
        if self.out is not None:  # a continuation was refused (4xx): the client's stream ends with it
            return await self._give_up(_AttemptFailed(f"http_{resp.status}", route.target, data[:300].decode(
                errors="replace")), route)
        self.p.metrics.ttft.labels(route.kind).observe(time.monotonic() - self.start)
        self.p._count(self.endpoint, route, "ok" if resp.status == 200 else f"http_{resp.status}", self.start)
        return web.Response(body=data, status=resp.status, headers=_route_headers(route),
                            content_type=resp.content_type or "application/json")

    async def _relay_stream(self, route: Route, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        if self.out is None:
            self.out = web.StreamResponse(status=200, headers={**_route_headers(route), "Cache-Control": "no-cache"})
            self.out.content_type = "text/event-stream"
            await self.out.prepare(self.request)
        parser = replay.SSEParser()
        while True:
            try:
                chunk = await resp.content.readany()
            except _UPSTREAM_ERRORS as exc:
                if self.stitch.finished:
                    break
                raise _AttemptFailed("mid_stream", route.target, repr(exc)) from exc
            if not chunk:
                break
            for data in parser.feed(chunk):
                try:
                    piece = self.stitch.on_event(data)
                except replay.UpstreamFailed as exc:
                    raise _AttemptFailed("error_event", route.target, str(exc)) from exc
                if piece is None:
                    continue
                if self._first:
                    self.p.metrics.ttft.labels(route.kind).observe(time.monotonic() - self.start)
                    self._first = False
                self.p.pools.decode_progress(route.req_id, 1)
                if not await self._write(piece):
                    self.p._count(self.endpoint, route, "client_gone", self.start)
                    return self.out
        if not self.stitch.finished:
            raise _AttemptFailed("mid_stream", route.target, "the stream ended before its last token")
        return await self._close_with(b"", route)

    # ------------------------------------------------------------ ending
    async def _write(self, data: bytes) -> bool:
        """False when the client went away (closing upstream then aborts its request)."""
        try:
            await self.out.write(data)
            return True
        except (ConnectionError, RuntimeError):
            self.out[_FAILED] = True
            return False

    async def _close_with(self, data: bytes, route: Route | None) -> web.StreamResponse:
        if await self._write(data + b"data: [DONE]\n\n"):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.out.write_eof()
        if route is not None:
            self.p._count(self.endpoint, route, "ok", self.start)
        return self.out

    async def _give_up(self, last: _AttemptFailed | None, route: Route | None) -> web.StreamResponse:
        if self.out is not None and self.out.get(_FAILED, False):  # the client left while we waited
            if route is not None:
                self.p._count(self.endpoint, route, "client_gone", self.start)
            return self.out
        message = f"the request failed on every attempt; last: {last}" if last else \
            "no healthy instance came back to replay the request on"
        logger.error("%s request given up: %s", self.endpoint, message)
        if route is not None:
            self.p._count(self.endpoint, route, "error", self.start)
        if self.out is None:
            return error_response(502, message)
        self.out[_FAILED] = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.out.write(_sse_error(message))
            await self.out.write_eof()
        return self.out


async def _read(resp: aiohttp.ClientResponse, target: Instance) -> bytes:
    try:
        return await resp.read()
    except _UPSTREAM_ERRORS as exc:
        raise _AttemptFailed("mid_response", target, repr(exc)) from exc


def _route_headers(route: Route) -> dict[str, str]:
    headers = {"x-disagg-route": route.kind, "x-disagg-decode": route.target.url}
    if route.prefill is not None:
        headers["x-disagg-prefill"] = route.prefill.url
    return headers


def _client_gone(request: web.Request) -> bool:
    """The client closed its connection (aiohttp drops the transport when it notices)."""
    transport = request.transport
    return transport is None or transport.is_closing()
