# SPDX-License-Identifier: Apache-2.0
"""The router's aiohttp application: one OpenAI-compatible endpoint in front of the P/D pools.

Routes: every route of plain `vllm serve`, by class (`api.py`): completions and chat through P/D
(streaming included), other generation whole on one instance, stateless routes on any healthy
instance, admin routes fanned out, stored responses sticky; plus the router's own GET /health (503
until every pool that has members has a healthy one, then 200 while some instance can decode; JSON
pool snapshot), /ping and /metrics. `--api-key` guards /v1, /v2, /inference and /cohere as on
`vllm serve`. `RouterServer` runs it inside an existing event loop (the launcher); `run_router`
blocks (the CLI).
"""

from __future__ import annotations

import hashlib
import logging
import secrets

from aiohttp import web

from vllm_disagg.liveness import MAX_BODY_BYTES
from vllm_disagg.observe import logs, tracing
from vllm_disagg.router import api, context
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.forward import Forwarder, not_found
from vllm_disagg.router.health import HealthChecker
from vllm_disagg.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from vllm_disagg.router.policy import Pool, SchedulerConfig
from vllm_disagg.router.pools import InstancePools
from vllm_disagg.router.proxy import Proxy

logger = logging.getLogger(__name__)

_APP_KEY = web.AppKey("disagg_router", object)
_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
_REQUEST_ID = web.RequestKey("disagg_request_id", str)
_UNTRACED = frozenset(("/health", "/ping", "/metrics"))


class Router:
    """Pools + health + proxy + metrics of one router; `app` serves them."""

    def __init__(self, config: RouterConfig, scheduler_config: SchedulerConfig | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.pools = InstancePools(config, self.metrics, scheduler_config)
        self.health = HealthChecker(self.pools, config)
        self.proxy = Proxy(self.pools, self.health, self.metrics, config)
        self.forward = Forwarder(self)
        self._ready = False  # every pool with members had a healthy one (start-up is over)
        self._api_keys = [hashlib.sha256(k.encode()).digest() for k in config.api_keys]
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        self.app[_APP_KEY] = self
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        self.app.on_response_prepare.append(self._on_prepare)
        self.app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/health", self._health),
            web.get("/ping", self._health),
            web.post("/ping", self._health),
            web.get("/metrics", self._metrics),
            web.route("*", "/{tail:.*}", self._by_class),
        ])

    async def _on_startup(self, _app: web.Application) -> None:
        await self.proxy.start()
        await self.health.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.health.stop()
        await self.proxy.stop()

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """`vllm serve --api-key`'s check: Bearer token on /v1, /v2, /inference, /cohere (not OPTIONS)."""
        if self._api_keys and request.method != "OPTIONS" and request.path.startswith(_GUARDED_PREFIX):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            digest = hashlib.sha256(token.encode()).digest()
            if scheme.lower() != "bearer" or not any(secrets.compare_digest(digest, k) for k in self._api_keys):
                return web.json_response({"error": "Unauthorized"}, status=401)
        request[_REQUEST_ID] = context.request_id_of(request.headers)
        context.bind(request[_REQUEST_ID], request.headers.get("Authorization"))
        if request.path in _UNTRACED or not tracing.enabled():
            logs.bind(request[_REQUEST_ID])
            return await handler(request)
        return await self._traced(request, handler)

    async def _traced(self, request: web.Request, handler) -> web.StreamResponse:
        """The request's root span (`router.request`, child of an incoming `traceparent`): every
        upstream call made for it carries it as parent, so P, D and their engines join the trace."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = tracing.context_from_headers(request.headers)
        span = tracing.tracer().start_span("router.request", context=parent, kind=SpanKind.SERVER, attributes={
            "disagg.request_id": request[_REQUEST_ID], "http.method": request.method, "http.route": request.path})
        token = context.set_span(span)
        logs.bind(request[_REQUEST_ID], tracing.trace_id_hex(span))
        try:
            resp = await handler(request)
            span.set_attribute("http.status_code", resp.status)
            if resp.status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {resp.status}"))
            return resp
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, repr(exc)[:200]))
            raise
        finally:
            context.reset_span(token)
            span.end()

    @staticmethod
    async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if _REQUEST_ID in request:  # streamed answers too: set before their headers go out
            response.headers.setdefault("X-Request-Id", request[_REQUEST_ID])

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.generate(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.generate(request, "chat/completions")

    async def _by_class(self, request: web.Request) -> web.StreamResponse:
        cls, known = api.classify(request.method, request.path)
        if cls is None or cls in (api.RouteClass.PD, api.RouteClass.LOCAL):
            return not_found(known)
        return await self.forward.handle(request, cls)

    async def _health(self, _request: web.Request) -> web.Response:
        """503 while the deployment comes up (a static pool that never had a healthy member,
        `pools.starting`; under discovery, until P and D were each seen healthy); then 200 while any
        instance is healthy, "degraded" when a pool has none: a lost decode pool leaves P serving whole
        requests, a lost prefill pool D, and a load balancer in front of several routers must not take
        this one out for it. 503 again only with no healthy instance at all."""
        healthy = self.pools.healthy_instances()
        pools = {i.pool for i in self.pools.instances.values()}
        expected = pools | ({Pool.DECODE} if Pool.PREFILL in pools else set())  # discovery may not have D yet
        missing = sorted(p.value for p in expected - {i.pool for i in healthy})
        restarted = self.pools.static and not self.pools.starting()  # discovery: every pool seen once first
        up = bool(pools) and (not missing or (bool(healthy) and restarted))
        self._ready = self._ready or up
        ok = self._ready and bool(healthy)
        if ok:
            status = "ok" if not missing else f"degraded: no healthy {', '.join(missing)} instance"
        elif not pools:
            status = "no instances"
        else:
            status = f"waiting for a healthy {', '.join(missing) or 'decode'} instance"
        return web.json_response({"status": status, "instances": self.pools.snapshot()}, status=200 if ok else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


class RouterServer:
    """Runs a `Router` on host:port inside the caller's event loop."""

    def __init__(self, router: Router, host: str, port: int) -> None:
        self.router, self.host, self.port = router, host, port
        self._runner = web.AppRunner(router.app, access_log=None)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:  # report the port the OS picked
            self.port = self._runner.addresses[0][1]
        logger.info("disagg router listening on %s", self.url)

    async def stop(self) -> None:
        await self._runner.cleanup()


def run_router(config: RouterConfig, host: str, port: int,
               scheduler_config: SchedulerConfig | None = None, args=None) -> int:
    """Serve until SIGINT/SIGTERM (the `vllm-disagg router` command); `args` may pick a discovery source."""
    router = Router(config, scheduler_config)
    if args is not None:
        from vllm_disagg.router.discovery import attach_from_args

        attach_from_args(router, args)
    print(f"disagg router on http://{host}:{port}  (OpenAI API at /v1)", flush=True)
    web.run_app(router.app, host=host, port=port, access_log=None, print=None,
                handle_signals=True, shutdown_timeout=5.0, reuse_port=bool(getattr(args, "reuse_port", False)))
    return 0


__all__ = ["Router", "RouterServer", "run_router"]
