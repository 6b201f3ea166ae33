# SPDX-License-Identifier: Apache-2.0
"""`ReplayRun`: one single-prompt request, re-sent until an attempt ends the answer.

When the instance refuses, answers 5xx, or dies before its last token, the request goes again to
a healthy instance (the same one once it is back, or another), as a continuation of the tokens the
client already has (replay.py stitches them), so the client sees one uninterrupted answer. An
attempt whose instance leaves routing (failed health checks, discovery removed it, another request
saw it die) is cut at once and replayed, instead of waiting out `read_timeout_s` on a hung instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from vllm_disagg.router import bodies, replay, spans
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

# Attempt failures that mean the instance is gone: it leaves routing until a health poll restores it.
_INSTANCE_GONE = ("connect", "no_answer", "mid_stream", "mid_response")


class _AttemptFailed(Exception):
    """One replayable attempt failed in a way that a re-send can fix."""

    def __init__(self, reason: str, instance: Instance, detail: str) -> None:
        super().__init__(f"{reason} on {instance.url}: {detail}")
        self.reason, self.instance = reason, instance


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
        self._cut_reason = "left_routing"  # or "stalled_release": moved off a suspect instance, not cut
        self._target: Instance | None = None  # the current attempt's instance
        self._prefill: Instance | None = None  # ... and its prefill instance (push path)
        self._attempt_tokens = 0  # ... and the tokens it relayed
        self._p_task: asyncio.Task | None = None  # ... and P's request
        self._post: asyncio.Task | None = None  # the current attempt's request, until its headers came
        self._resp: aiohttp.ClientResponse | None = None  # ... and its response after that
        self._next_ping = 0.0

    async def run(self) -> web.StreamResponse:
        last: _AttemptFailed | None = None
        route: Route | None = None
        for attempt in range(1 + self.p.config.replay_attempts):
            if attempt:
                self.p.replays.labels(self.endpoint, last.reason).inc()
                spans.event("replay", reason=last.reason, attempt=attempt + 1, instance=last.instance.url,
                            num_tokens_sent=len(self.stitch.generated) if self.stitch else 0)
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
            self.p.cuts[route.req_id] = self._cut
            self.p.releases[route.req_id] = self._release
            try:
                return await self._attempt(route)
            except _AttemptFailed as exc:
                last = exc
                if self._cut_exc is not None and exc.__cause__ is self._cut_exc:  # failed by our cut, not on its own
                    last = exc = _AttemptFailed(self._cut_reason, exc.instance, "left routing mid-answer")
                if exc.reason in _INSTANCE_GONE:  # one that still answers (5xx, error event) stays routable
                    self.p.health.drop(exc.instance, str(exc))
            finally:
                self.p.cuts.pop(route.req_id, None)
                self.p.releases.pop(route.req_id, None)
                self._cut_from = self._cut_exc = self._target = self._post = self._resp = None
                self._cut_reason = "left_routing"
                self._prefill = self._p_task = None
                self._attempt_tokens = 0
                self.p.pools.done(route.req_id)
        return await self._give_up(last, route)

    # ----------------------------------------------------------- routing
    def _estimates(self) -> tuple[int, int]:
        stitch = self.stitch
        if stitch is not None and stitch.prompt_ids is not None and stitch.generated:
            return len(stitch.prompt_ids) + len(stitch.generated), max(1, stitch.remaining() or 1)
        return (bodies.estimate_prompt_tokens(self.body, self.chat),
                bodies.expected_output_tokens(self.body, self.chat))

    async def _keepalive(self) -> bool:
        """While waiting: an SSE comment every few seconds on a started stream; False if the client left."""
        if self.out is None or time.monotonic() < self._next_ping:
            return True
        self._next_ping = time.monotonic() + self._KEEPALIVE_S
        return await self._write(b": waiting for a healthy instance to replay on\n\n")

    def _cut(self, instance_id: str, reason: str = "left_routing") -> None:
        """The current attempt's instance left routing: fail the attempt now (it is replayed). So does
        its prefill instance (stuck, or dead) while nothing of this attempt reached the client: D would
        wait up to push_timeout_s for that push; the replay goes to a route without it."""
        route_target, pre = self._target, self._prefill
        if route_target is None or self._cut_from is not None:
            return
        if route_target.instance_id != instance_id:
            if pre is None or pre.instance_id != instance_id or self._attempt_tokens or self._p_answered():
                return  # its prefill left after the push: D has the KV (or recomputes), the attempt goes on
        self._cut_from, self._cut_reason = instance_id, reason
        logger.warning("%s a %s request off %s: %s", "cutting" if reason == "left_routing" else "moving",
                       self.endpoint, route_target.url,
                       ("it" if route_target.instance_id == instance_id else f"its prefill instance {pre.url}")
                       + (" left routing" if reason == "left_routing" else " owes progress past its soft limit"))
        if self._resp is not None:  # an attempt that already failed on its own keeps its own reason
            self._cut_exc = ConnectionResetError(f"{route_target.url} left routing")
            self._resp.content.set_exception(self._cut_exc)
        elif self._post is not None:
            self._post.cancel()

    def _release(self, instance_id: str) -> None:
        """The attempt's instance is suspect (router/health.py): move the request while the client has
        seen none of its tokens, so the replay costs a re-prefill and no stitching."""
        if self._first:  # no token of any attempt has been relayed yet
            self._cut(instance_id, "stalled_release")

    def _p_answered(self) -> bool:
        return self._p_task is not None and self._p_task.done()

    # ----------------------------------------------------------- attempt
    async def _attempt(self, route: Route) -> web.StreamResponse:
        body, endpoint = self.body, self.endpoint
        if self.stitch is not None:
            mml = await self.p.max_model_len(route.target) if self.stitch.needs_max_model_len() else None
            if self.stitch.needs_max_model_len() and mml is None:
                raise _AttemptFailed("no_answer", route.target, "no max_model_len for the continuation")
            body, endpoint = self.stitch.next_request(self.endpoint, mml)
        p_task, d_body = await self.p.start_prefill(route, body, endpoint)
        self._prefill, self._p_task = route.prefill, p_task
        ok = False
        try:
            with spans.phase("router.decode", instance=route.target.url, route=route.kind):
                out = await self._relay(route, d_body, endpoint)
            ok = out.status == 200 and not out.get(FAILED, False)  # D refused it (4xx): P's push is orphaned
            return out
        finally:
            await self.p.end_prefill(p_task, ok, d_body)

    async def _relay(self, route: Route, d_body: dict[str, Any], endpoint: str) -> web.StreamResponse:
        target = self._target = route.target
        # A task, so that `_cut` can end the wait for the headers (a hung instance sends none).
        self._post = asyncio.ensure_future(self.p.session.post(f"{target.url}/v1/{endpoint}", json=d_body))
        try:
            resp = await await_headers(self._post, lambda: self._cut_from is not None)
        except UPSTREAM_ERRORS as exc:
            reason = "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "no_answer"
            raise _AttemptFailed(reason, target, repr(exc)) from exc
        if resp is None:
            raise _AttemptFailed(self._cut_reason, target, "left routing before it answered")
        self._resp = resp
        if self._cut_from is not None:  # cut between the headers and here
            resp.close()
            raise _AttemptFailed(self._cut_reason, target, "left routing before it answered")
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
        self.p.count(self.endpoint, route, "ok" if resp.status == 200 else f"http_{resp.status}", self.start)
        return web.Response(body=data, status=resp.status, headers=route_headers(route),
                            content_type=resp.content_type or "application/json")

    async def _relay_stream(self, route: Route, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        if self.out is None:
            self.out = web.StreamResponse(status=200, headers={**route_headers(route), "Cache-Control": "no-cache"})
            self.out.content_type = "text/event-stream"
            await self.out.prepare(self.request)
        parser = replay.SSEParser()
        while True:
            try:
                chunk = await resp.content.readany()
            except UPSTREAM_ERRORS as exc:
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
                route.target.last_progress = time.monotonic()  # the stall watchdog's evidence
                self._attempt_tokens += 1
                self.p.pools.decode_progress(route.req_id, 1)
                if not await self._write(piece):
                    self.p.count(self.endpoint, route, "client_gone", self.start)
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
            self.out[FAILED] = True
            return False

    async def _close_with(self, data: bytes, route: Route | None) -> web.StreamResponse:
        if await self._write(data + b"data: [DONE]\n\n"):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.out.write_eof()
        if route is not None:
            self.p.count(self.endpoint, route, "ok", self.start)
        return self.out

    async def _give_up(self, last: _AttemptFailed | None, route: Route | None) -> web.StreamResponse:
        if self.out is not None and self.out.get(FAILED, False):  # the client left while we waited
            if route is not None:
                self.p.count(self.endpoint, route, "client_gone", self.start)
            return self.out
        message = f"the request failed on every attempt; last: {last}" if last else \
            "no healthy instance came back to replay the request on"
        logger.error("%s request given up: %s", self.endpoint, message)
        if route is not None:
            self.p.count(self.endpoint, route, "error", self.start)
        if self.out is None:
            return error_response(502, message)
        self.out[FAILED] = True
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.out.write(sse_error(message))
            await self.out.write_eof()
        return self.out


async def _read(resp: aiohttp.ClientResponse, target: Instance) -> bytes:
    try:
        return await resp.read()
    except UPSTREAM_ERRORS as exc:
        raise _AttemptFailed("mid_response", target, repr(exc)) from exc
