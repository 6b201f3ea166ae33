# SPDX-License-Identifier: Apache-2.0
"""Health checks: poll every instance's GET /health and drop dead ones from their pool.

An instance is dropped after `health_failures_to_drop` consecutive failed polls (error status, refused
connection or no answer within `health_timeout_s`), or at once when the proxy sees it refuse a
connection, or when it has not passed a single check yet (it is still starting: the first poll runs
before the router serves, so a request that comes early waits for admission instead of failing on
it). One good poll restores it. Lifecycle: `start()` -> periodic `poll_once()` -> `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.pools import Instance, InstancePools

logger = logging.getLogger(__name__)


class HealthChecker:
    """Keeps `InstancePools` membership in step with what the instances answer."""

    def __init__(self, pools: InstancePools, config: RouterConfig) -> None:
        self.pools = pools
        self.config = config
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        await self.poll_once()
        self._task = asyncio.create_task(self._loop(), name="disagg-router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.poll_once()
            except Exception:  # keep polling whatever one round hit
                logger.exception("health poll failed")

    async def poll_once(self) -> None:
        instances = list(self.pools.instances.values())
        results = await asyncio.gather(*(self._check(i) for i in instances))
        for inst, ok in zip(instances, results, strict=True):
            self.record(inst, ok)

    async def _check(self, inst: Instance) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{inst.url}/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def record(self, inst: Instance, ok: bool) -> None:
        if ok:
            inst.num_failed_checks = 0
            if self.pools.set_healthy(inst.instance_id, True):
                logger.info("instance %s (%s) is healthy%s", inst.url, inst.pool.value,
                            " again" if inst.seen_healthy else "")
                if inst.seen_healthy:
                    self.pools.metrics.instance_rejoins.labels(inst.pool.value, inst.url).inc()
            inst.seen_healthy = True
            return
        inst.num_failed_checks += 1
        if not inst.seen_healthy:
            if self.pools.set_healthy(inst.instance_id, False):
                logger.info("instance %s (%s) is not up yet: routed once it passes a health check", inst.url,
                            inst.pool.value)
        elif inst.num_failed_checks >= self.config.health_failures_to_drop:
            self.drop(inst, f"{inst.num_failed_checks} failed health checks")

    def drop(self, inst: Instance, why: str) -> None:
        """Remove an instance from routing now (also used when the proxy sees it refuse connections)."""
        inst.num_failed_checks = max(inst.num_failed_checks, self.config.health_failures_to_drop)
        if self.pools.set_healthy(inst.instance_id, False):
            logger.warning("dropping instance %s (%s) from its pool: %s", inst.url, inst.pool.value, why)
