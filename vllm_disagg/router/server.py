# SPDX-License-Identifier: Apache-2.0
"""The router's aiohttp application: one OpenAI-compatible endpoint in front of the P/D pools.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming included), GET /v1/models,
GET /health (200 while some instance can decode; JSON pool snapshot), GET /metrics (Prometheus).
`RouterServer` runs it inside an existing event loop (the launcher); `run_router` blocks (the CLI).
"""

from __future__ import annotations

import logging

from aiohttp import web

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.health import HealthChecker
from vllm_disagg.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from vllm_disagg.router.policy import Pool, SchedulerConfig
from vllm_disagg.router.pools import InstancePools
from vllm_disagg.router.proxy import Proxy

logger = logging.getLogger(__name__)

_APP_KEY = web.AppKey("disagg_router", object)


class Router:
    """Pools + health + proxy + metrics of one router; `app` serves them."""

    def __init__(self, config: RouterConfig, scheduler_config: SchedulerConfig | None = None) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.pools = InstancePools(config, self.metrics, scheduler_config)
        self.health = HealthChecker(self.pools, config)
        self.proxy = Proxy(self.pools, self.health, self.metrics, config)
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app[_APP_KEY] = self
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        self.app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])

    async def _on_startup(self, _app: web.Application) -> None:
        await self.proxy.start()
        await self.health.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.health.stop()
        await self.proxy.stop()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.generate(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.generate(request, "chat/completions")

    async def _models(self, _request: web.Request) -> web.Response:
        return await self.proxy.forward_get("/v1/models")

    async def _health(self, _request: web.Request) -> web.Response:
        live = [i for i in self.pools.healthy_instances() if i.pool in (Pool.DECODE, Pool.MIXED)]
        status = 200 if live else 503
        return web.json_response({"status": "ok" if live else "no decode instance",
                                  "instances": self.pools.snapshot()}, status=status)

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
                handle_signals=True, shutdown_timeout=5.0)
    return 0


__all__ = ["Router", "RouterServer", "run_router"]
