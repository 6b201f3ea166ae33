# SPDX-License-Identifier: Apache-2.0
"""Executes routes: the P/D push path (pd_protocol.md) and whole requests on one instance.

Push path: P gets `max_tokens=1` + `do_remote_decode`, D the client's body + `do_remote_prefill`,
both at once with one `transfer_id`; D's answer is relayed byte for byte, P's only checked for
errors (when P fails, D recomputes the prompt). Single-prompt requests go through `ReplayRun`
(replay_run.py); others (batch prompts, n > 1, echo) are relayed as they are (relay.py) and
re-routed once on a refused connection.
Admission: a new request that finds no healthy instance waits up to `admission_wait_s`, woken by
the scheduler's membership callback, then gets 503. Nothing waits without a timeout.
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

from vllm_disagg.router import bodies, context, replay, spans
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.health import HealthChecker
from vllm_disagg.router.metrics import RouterMetrics
from vllm_disagg.router.policy import NoHealthyInstanceError
from vllm_disagg.router.pools import Instance, InstancePools, Route
from vllm_disagg.router.push_cancel import PushCanceller
from vllm_disagg.router.relay import ConnectFailed, Relay
from vllm_disagg.router.replay_run import ReplayRun
from vllm_disagg.router.upstream import FAILED, UPSTREAM_ERRORS, client_gone, error_response

logger = logging.getLogger(__name__)

# How often a waiting request checks that its client is still connected (aiohttp has no event for it).
_CLIENT_CHECK_S = 1.0
_WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_RETRY_AFTER_S = 2


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
            "(admitted, timed_out, client_gone, queue_full).", ["outcome"], buckets=_WAIT_BUCKETS,
            registry=metrics.registry,
        )
        self._joined = asyncio.Event()  # replaced after each set: waiters hold the one they saw
        self.cuts: dict[str, Callable[[str], None]] = {}  # req_id -> cut its attempt (instance left)
        self.releases: dict[str, Callable[[str], None]] = {}  # req_id -> move it if not started (suspect)
        self.num_waiting = 0  # new requests waiting for admission (bounded by max_waiting)
        self.push_cancel = PushCanceller(config.auth_token) if config.auth_token else None
        """CANCELs pushes whose decode half was given up after P answered (None: no shared token here)."""
        pools.scheduler.listeners.append(self._on_membership)
        health.on_suspect.append(self._on_suspect)

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                        sock_read=self.config.read_timeout_s)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
                                                 limit=0, keepalive_timeout=self.config.idle_keepalive_s),
                                             trace_configs=[context.trace_config()])

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.push_cancel is not None:
            await self.push_cancel.stop()
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
            except ConnectFailed as exc:
                self.health.drop(exc.instance, exc.why)
                reason = "reroute_connect_error" if exc.why == "refused a connection" else "reroute_left_routing"
                self.metrics.fallbacks.labels(reason).inc()
                spans.event("fallback", reason=reason, instance=exc.instance.url)
            finally:
                self.pools.done(route.req_id)
        self.metrics.requests.labels(endpoint, "none", "error").inc()
        return error_response(502, "every instance tried refused the connection or left routing before it answered")

    # --------------------------------------------------------- admission
    def _on_membership(self, instance_id: str, healthy: bool, lost: list[str]) -> None:
        """Scheduler callback: wake waiting requests on a join; cut attempts on an instance that left."""
        if healthy:
            self._joined.set()
            self._joined = asyncio.Event()
            return
        for req_id in lost:
            cut = self.cuts.get(req_id)
            if cut is not None:
                cut(instance_id)

    def _on_suspect(self, inst: Instance) -> None:
        """Health callback: `inst` owes progress past its soft limit and another instance can take
        its requests; those that showed the client nothing are replayed there now."""
        for req_id in self.pools.scheduler.requests_on(inst.instance_id):
            release = self.releases.get(req_id)
            if release is not None:
                release(inst.instance_id)

    async def route_when_ready(self, request: web.Request, estimates: Callable[[], tuple[int, int]],
                               allow_pd: bool, wait_s: float,
                               tick: Callable[[], Awaitable[bool]] | None = None,
                               admission: bool = True) -> tuple[Route | None, str]:
        """A route, waiting up to `wait_s` for a healthy instance; (None, why) when none came.

        `why` is "timed_out" or "client_gone". `tick` runs about once a second while waiting (a
        started stream's keep-alive); False from it ends the wait as "client_gone". Waits of new
        requests (`admission`) go into the admission histogram; a replay's wait does not."""
        with spans.phase("router.admission" if admission else "router.replay_wait") as span:
            route, why = await self._route_when_ready(request, estimates, allow_pd, wait_s, tick, admission)
            spans.annotate(span, outcome=why, **(spans.route_attrs(route) if route else {}))
            return route, why

    async def _route_when_ready(self, request: web.Request, estimates: Callable[[], tuple[int, int]],
                                allow_pd: bool, wait_s: float, tick: Callable[[], Awaitable[bool]] | None,
                                admission: bool) -> tuple[Route | None, str]:
        route = self._try_route(estimates, allow_pd, wait_for_start=admission and wait_s > 0)
        if route is not None:
            return route, "admitted"
        if wait_s <= 0:
            return None, "timed_out"
        if admission and self.num_waiting >= self.config.max_waiting:
            self.admission_waits.labels("queue_full").observe(0.0)
            return None, "queue_full"
        self.num_waiting += admission
        try:
            return await self._wait_for_route(request, estimates, allow_pd, wait_s, tick, admission)
        finally:
            self.num_waiting -= admission

    async def _wait_for_route(self, request: web.Request, estimates: Callable[[], tuple[int, int]],
                              allow_pd: bool, wait_s: float, tick: Callable[[], Awaitable[bool]] | None,
                              admission: bool) -> tuple[Route | None, str]:
        t0 = time.monotonic()
        deadline = t0 + wait_s
        logger.debug("no healthy instance for a request: waiting up to %.0f s for one", wait_s)
        while True:
            joined = self._joined
            left = deadline - time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(joined.wait(), timeout=max(0.0, min(left, _CLIENT_CHECK_S)))
            gone = client_gone(request) or (tick is not None and not await tick())
            route = why = None
            if gone:
                why = "client_gone"
            else:
                late = time.monotonic() >= deadline
                route = self._try_route(estimates, allow_pd, wait_for_start=admission and not late)
                if route is not None:
                    why = "admitted"
                elif late:
                    why = "timed_out"
            if why is not None:
                if admission:
                    self.admission_waits.labels(why).observe(time.monotonic() - t0)
                return route, why

    def _try_route(self, estimates: Callable[[], tuple[int, int]], allow_pd: bool,
                   wait_for_start: bool) -> Route | None:
        """A route, or None while no instance can take the request. `wait_for_start`: also None while
        the deployment is still starting (a pool never had a healthy member), so the first requests
        take the P/D path instead of going whole to a D that came up before P; when the admission wait
        runs out they go wherever they can."""
        if wait_for_start and self.pools.starting():
            return None
        try:
            return self.pools.route(*estimates(), allow_pd=allow_pd)
        except NoHealthyInstanceError:
            return None

    def no_route_response(self, endpoint: str, why: str) -> web.Response:
        """503 with Retry-After for a request no instance took: after the admission wait, or at once when
        `max_waiting` requests already wait (a bounded queue: the client retries, nothing piles up here)."""
        outcome = {"client_gone": "client_gone", "queue_full": "queue_full"}.get(why, "no_instance")
        self.metrics.requests.labels(endpoint, "none", outcome).inc()
        if why == "queue_full":
            message = (f"{self.config.max_waiting} requests already wait for a healthy instance (--max-waiting); "
                       "retry later")
        else:
            message = "no healthy vLLM instance can serve this request"
        return error_response(503, message, "ServiceUnavailable", headers={"Retry-After": str(_RETRY_AFTER_S)})

    async def forward_get(self, path: str) -> web.Response:
        """GET endpoints any instance answers the same (/v1/models)."""
        inst = self.pools.any_healthy()
        if inst is None:
            return error_response(503, "no healthy vLLM instance", "ServiceUnavailable")
        try:
            async with self.session.get(f"{inst.url}{path}") as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status, content_type=resp.content_type)
        except UPSTREAM_ERRORS as exc:
            return error_response(502, f"instance {inst.url} failed: {exc!r}")

    # ----------------------------------------------------------- one try
    async def _serve(self, request: web.Request, route: Route, body: dict[str, Any], endpoint: str,
                     start: float) -> web.StreamResponse:
        p_task, d_body = await self.start_prefill(route, body, endpoint)
        relay = Relay(self, route)
        self.cuts[route.req_id] = relay.cut
        ok = False
        try:
            with spans.phase("router.decode", instance=route.target.url, route=route.kind):
                out = await relay.run(request, d_body, endpoint, start)
            ok = out.status == 200 and not out.get(FAILED, False)
            return out
        finally:
            self.cuts.pop(route.req_id, None)
            await self.end_prefill(p_task, ok, d_body)

    async def start_prefill(self, route: Route, body: dict[str, Any],
                            endpoint: str) -> tuple[asyncio.Task | None, dict[str, Any]]:
        """Send P its half now (push path) and return it with D's body; plain routes get the body as is.
        vLLM's protocol runs P to its end first (D's body needs P's answer): no task comes back."""
        if route.prefill is None:
            if route.reason:
                self.metrics.fallbacks.labels(route.reason).inc()
                spans.event("fallback", reason=route.reason, instance=route.target.url)
            return None, bodies.plain_body(body)
        if self.config.pd_protocol == "vllm":
            return None, await self._vllm_prefill(route, body, endpoint)
        pre = route.prefill
        transfer_id = bodies.new_transfer_id()
        chat = endpoint == "chat/completions"
        p_task = asyncio.create_task(self._prefill(route, bodies.prefill_body(body, transfer_id, chat), endpoint))
        return p_task, bodies.decode_body(body, transfer_id, pre.kv_host, pre.kv_port, self.config.push_timeout_s)

    async def end_prefill(self, p_task: asyncio.Task | None, ok: bool, d_body: dict[str, Any]) -> None:
        if p_task is None:
            return
        if p_task.done():  # P answered: its push may wait for a D that will never register now
            if not ok and self.push_cancel is not None:
                self.push_cancel.cancel_later(d_body, "the router gave up on the decode half")
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
            except (*UPSTREAM_ERRORS, KeyError, IndexError, TypeError, ValueError) as exc:
                logger.warning("no max_model_len from %s: %r", inst.url, exc)
                return None
        return self._max_model_len[inst.url]

    async def _vllm_prefill(self, route: Route, body: dict[str, Any], endpoint: str) -> dict[str, Any]:
        """vLLM's P/D flow: P prefills (one token) and answers with the kv_transfer_params D needs to fetch
        the KV. When P fails or answers none, D gets the plain request and computes the prompt itself."""
        pre, t0 = route.prefill, time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s)
        answer: Any = None
        try:
            async with self.session.post(f"{pre.url}/v1/{endpoint}", timeout=timeout,
                                         json=bodies.vllm_prefill_body(body, endpoint == "chat/completions")) as resp:
                if resp.status == 200:
                    answer = await resp.json(content_type=None)
                else:
                    logger.warning("prefill on %s failed for %s: HTTP %d %s", pre.url, route.req_id, resp.status,
                                   (await resp.read())[:300])
        except aiohttp.ClientConnectorError as exc:
            self.health.drop(pre, f"refused a connection: {exc}")
        except (*UPSTREAM_ERRORS, json.JSONDecodeError) as exc:
            logger.warning("prefill on %s failed for %s: %r (decode computes the prompt)", pre.url, route.req_id, exc)
        finally:
            self.metrics.prefill_latency.observe(time.monotonic() - t0)
            self.pools.prefill_done(route.req_id)
        d_body = bodies.vllm_decode_body(body, answer)
        if d_body is None:
            self.metrics.prefill_failures.labels(pre.url).inc()
            return bodies.plain_body(body)
        return d_body

    async def _prefill(self, route: Route, p_body: dict[str, Any], endpoint: str) -> None:
        with spans.phase("router.prefill", instance=route.prefill.url):
            await self._prefill_call(route, p_body, endpoint)

    async def _prefill_call(self, route: Route, p_body: dict[str, Any], endpoint: str) -> None:
        pre = route.prefill
        t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s,
                                        sock_connect=self.config.connect_timeout_s)
        try:
            async with self.session.post(f"{pre.url}/v1/{endpoint}", json=p_body, timeout=timeout) as resp:
                data = await resp.read()
                pre.last_progress = time.monotonic()
                if resp.status != 200:
                    self.metrics.prefill_failures.labels(pre.url).inc()
                    logger.warning("prefill on %s failed for %s: HTTP %d %s", pre.url, route.req_id,
                                   resp.status, data[:300])
        except aiohttp.ClientConnectorError as exc:
            self.metrics.prefill_failures.labels(pre.url).inc()
            self.health.drop(pre, f"refused a connection: {exc}")
        except UPSTREAM_ERRORS as exc:
            self.metrics.prefill_failures.labels(pre.url).inc()
            logger.warning("prefill on %s failed for %s: %r (decode recomputes)", pre.url, route.req_id, exc)
        finally:
            self.metrics.prefill_latency.observe(time.monotonic() - t0)
            self.pools.prefill_done(route.req_id)

    def count(self, endpoint: str, route: Route, outcome: str, start: float) -> None:
        self.metrics.requests.labels(endpoint, route.kind, outcome).inc()
        if route.prefill is None:
            self.metrics.whole_requests.labels(route.target.pool.value).inc()
        self.metrics.latency.labels(route.kind).observe(time.monotonic() - start)
