# SPDX-License-Identifier: Apache-2.0
"""Health checks: poll every instance's GET /health and GET /live, drop dead and stuck ones.

Dropped after `health_failures_to_drop` consecutive failed polls (error status, refused connection, no
answer within `health_timeout_s`), after ONE when it never passed a check (still starting: an early
request waits for admission instead of failing on it), or at once when the proxy sees it refuse a
connection. One good poll restores it. Instances are polled independently.

Hang detection (`stall_timeout_s`): `/live` (vllm_disagg/liveness/) reports how long the engine has
owed progress. An instance with requests booked on it that shows no progress for `stall_timeout_s` is
dropped by the watchdog; the proxy then cuts and replays its requests. A stalled engine is not restored
by a good `/health` while `/live` still reports the stall. Lifecycle: `start()` -> polls -> `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from vllm_disagg.liveness import stall_limit_for
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.pools import Instance, InstancePools

logger = logging.getLogger(__name__)
_LIVE_RECHECK_S = 60.0
_PROBE_TIMEOUT_S = 1.0
"""A suspicion probe's wait for `/live`: a stopped API server never answers, but a live one can miss
0.25 s on 2 busy cores (engines' OpenMP threads spin on both): on an AVX2-only box both instances of
test_lamina_pd were marked at 0.25 s and its pushes were replayed as whole requests. 1 s costs a
SIGSTOPped instance's requests 0.75 s more."""


class HealthChecker:
    """Keeps `InstancePools` membership in step with what the instances answer."""

    def __init__(self, pools: InstancePools, config: RouterConfig) -> None:
        self.pools = pools
        self.config = config
        self._tasks: list[asyncio.Task] = []
        self._polls: dict[str, asyncio.Task] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        self.on_stall: list = []
        """Callbacks `(instance, stalled_s)` when the watchdog cuts an instance (metrics)."""
        self.on_suspect: list = []
        """Callbacks `(instance)` when an instance turns suspect and another can take its requests."""

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        connector = aiohttp.TCPConnector(keepalive_timeout=self.config.idle_keepalive_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        await self.poll_once()
        self._tasks = [asyncio.create_task(self._loop(), name="disagg-router-health"),
                       asyncio.create_task(self._watchdog(), name="disagg-router-stall-watchdog")]

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._polls.values(), *self._probes.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    async def _loop(self) -> None:
        """Every `health_interval_s`, poll each instance that has no poll in flight."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            for inst in list(self.pools.instances.values()):
                task = self._polls.get(inst.instance_id)
                if task is None or task.done():
                    inst.poll_sent_at = time.monotonic()
                    self._polls[inst.instance_id] = asyncio.create_task(self._poll(inst))
            for iid in [i for i, t in self._polls.items() if t.done() and i not in self.pools.instances]:
                del self._polls[iid]

    async def _poll(self, inst: Instance) -> None:
        try:
            self.record(inst, await self._check(inst))
        except Exception:  # keep polling whatever one round hit
            logger.exception("health poll of %s failed", inst.url)
        finally:
            inst.poll_sent_at = None

    async def poll_once(self) -> None:
        instances = list(self.pools.instances.values())
        results = await asyncio.gather(*(self._check(i) for i in instances))
        for inst, ok in zip(instances, results, strict=True):
            self.record(inst, ok)

    async def _check(self, inst: Instance) -> bool:
        """`/health` answers 200 and `/live` (where served) reports no stall past `stall_timeout_s`."""
        assert self._session is not None
        try:
            health, live = await asyncio.gather(self._get(inst, "/health"), self._live(inst))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
        if not health:
            return False
        if self._recovering(inst, live):
            return not self.pools.has_alternative(inst)  # elsewhere: it stays out until it is done
        now = time.monotonic()
        stalled = self._take_report(inst, live, now)
        if stalled is not None:
            return stalled <= self._limit_of(inst)
        inst.last_progress = now  # answering is all we can see of an instance that does not beat
        if self.pools.set_suspect(inst.instance_id, False):
            logger.info("instance %s (%s) answers again", inst.url, inst.pool.value)
        return True

    def _take_report(self, inst: Instance, live: dict | None, now: float) -> float | None:
        """Record a `/live` report (its `stalled_s`, None without one); one within the soft limit clears
        a suspect instance."""
        stalled = live.get("stalled_s") if live else None
        if not isinstance(stalled, (int, float)):
            return None
        inst.last_progress = now - float(stalled)
        inst.expected_step_s = _positive(live.get("expected_step_s"))
        inst.expected_progress_s = _positive(live.get("expected_progress_s", inst.expected_step_s))
        inst.stall_limit_s = self.stall_limit(inst.expected_step_s, inst.expected_progress_s)
        inst.release_limit_s = self.release_limit(inst.expected_step_s, inst.expected_progress_s)
        if (inst.release_limit_s is None or stalled <= inst.release_limit_s) and \
                self.pools.set_suspect(inst.instance_id, False):
            logger.info("instance %s (%s) makes progress again", inst.url, inst.pool.value)
        return float(stalled)

    def stall_limit(self, expected_step_s: object, expected_progress_s: object = None) -> float | None:
        """The adaptive stall limit for an instance reporting `expected_step_s` (None: the fixed one):
        `stall_factor` times it within [`stall_min_s`, `stall_timeout_s`], and never under
        `LONG_STEP_MARGIN` times the wait for its next sign of progress (`expected_progress_s`, default
        the step's): a long prefill step is not a hang, a long step whose layers report needs no margin."""
        factor = self.config.stall_factor
        if factor is None or not isinstance(expected_step_s, (int, float)) or expected_step_s <= 0:
            return None
        adaptive = min(self.config.stall_timeout_s, max(self.config.stall_min_s, factor * float(expected_step_s)))
        return stall_limit_for(expected_step_s if expected_progress_s is None else expected_progress_s, adaptive)

    def release_limit(self, expected_step_s: object, expected_progress_s: object = None) -> float | None:
        """The soft limit past which the router probes an instance (None: adaptive detection is off).
        An engine with too few steps for `expected_step_s` (just restarted) gets the adaptive floor, and
        is marked there only if `/live` does not answer (`_probe`): a restarted instance stopped again
        kept a request 4.4 s in the seed-1 soak while the cut waited for `stall_timeout_s`."""
        if self.config.stall_factor is None:
            return None
        limit = self.stall_limit(expected_step_s, expected_progress_s)
        if limit is None:
            return min(self.config.stall_timeout_s, max(self.config.stall_release_s, self.config.stall_min_s))
        return min(limit, max(self.config.stall_release_s, self.config.stall_factor * float(expected_step_s)))

    def _limit_of(self, inst: Instance) -> float:
        """The stall limit that cuts `inst`: the adaptive one only while another instance that steps
        could take its requests. Cut with none, they would wait for a replay anyway, and then for its
        rejoin (a health poll) and a re-prefill: in the 1P+1D soak, P stopped while D restarted
        kept its requests 6-9 s where the stop itself lasted less."""
        if inst.stall_limit_s is None or not self.pools.has_alternative(inst):
            return stall_limit_for(inst.expected_progress_s, self.config.stall_timeout_s)
        return inst.stall_limit_s

    async def _get(self, inst: Instance, path: str) -> bool:
        async with self._session.get(f"{inst.url}{path}") as resp:
            return resp.status == 200

    async def _live(self, inst: Instance) -> dict | None:
        """The instance's `/live` report; None when it has no such endpoint (no liveness middleware)."""
        now = time.monotonic()
        if inst.has_live is False and now < inst.live_asked_at + _LIVE_RECHECK_S:
            return None
        inst.live_asked_at = now
        async with self._session.get(f"{inst.url}/live") as resp:
            if resp.status == 404:  # asked again now and then: a restarted instance may have it
                inst.has_live = False
                return None
            inst.has_live = True
            try:
                report = await resp.json(content_type=None)
            except ValueError:
                return None
            return report if isinstance(report, dict) else None

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

    # ------------------------------------------------------------- stall watchdog
    async def _watchdog(self) -> None:
        period = 0.1 if self.config.stall_factor else min(0.5, self.config.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.check_stalls(time.monotonic())

    def check_stalls(self, now: float) -> list[Instance]:
        """Drop every routable instance that has requests booked and no progress past its stall limit;
        mark one past its soft limit suspect. An instance owes progress only since it last had nothing
        booked: an idle one polled a while ago is not stalled."""
        cut = []
        for inst in list(self.pools.instances.values()):
            num = self.pools.num_booked(inst.instance_id)
            if not num:
                inst.idle_at = now
            stalled = now - max(inst.last_progress, inst.idle_at)
            if not self.pools.is_healthy(inst.instance_id):
                continue
            limit = self._limit_of(inst)
            if num and stalled > limit:
                why = (f"adaptive limit {limit:.1f} s" if limit != self.config.stall_timeout_s
                       else f"--stall-timeout-s {self.config.stall_timeout_s:g}")
                self.drop(inst, f"no progress for {stalled:.1f} s with {num} requests on it ({why})")
                for callback in self.on_stall:
                    callback(inst, stalled)
                cut.append(inst)
            elif self._unanswered(inst, now, num, stalled):
                self.suspect(inst, f"its health poll has had no answer for {now - inst.poll_sent_at:.1f} s")
            elif num and inst.release_limit_s is not None and stalled > inst.release_limit_s:
                self._probe_soon(inst)
        return cut

    def _unanswered(self, inst: Instance, now: float, num_booked: int, stalled: float) -> bool:
        """A poll in flight past `_PROBE_TIMEOUT_S` from an instance that answered before: a SIGSTOPped
        one, caught while idle. Only the probe caught it before, once a request had waited out the soft
        limit on it: the first request to each router after a stop took 1.5 s (Lamina soak, seed 2,
        8-10 s into a stop). A busy one is suspect only if it also shows no progress past that limit."""
        release = inst.release_limit_s if inst.release_limit_s is not None else self.release_limit(None)
        if release is None or inst.poll_sent_at is None or not inst.seen_healthy:
            return False
        return now - inst.poll_sent_at > _PROBE_TIMEOUT_S and (not num_booked or stalled > release)

    # ------------------------------------------------------------- suspicion
    def _probe_soon(self, inst: Instance) -> None:
        """The router has seen no progress past the soft limit: ask `/live` now rather than act on an
        extrapolation (a busy prefill instance shows nothing between polls)."""
        task = self._probes.get(inst.instance_id)
        if not self.pools.is_suspect(inst.instance_id) and (task is None or task.done()):
            self._probes[inst.instance_id] = asyncio.create_task(self._probe(inst))

    async def _probe(self, inst: Instance) -> None:
        """Mark `inst` suspect when `/live` does not answer, or when its engine, knowing its own step
        time, says it owes progress past the soft limit. A cold engine (no `expected_step_s` yet) that
        answers is left to the fixed limit: its first forward may take seconds on a loaded box (CI:
        2.08 s, over the 2 s floor, moved a healthy decode instance's requests and their KV pushes)."""
        try:
            live = await asyncio.wait_for(self._live(inst), _PROBE_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            self.suspect(inst, f"no /live answer within {_PROBE_TIMEOUT_S:g} s")
            return
        if self._recovering(inst, live):
            return
        stalled = self._take_report(inst, live, time.monotonic())
        if stalled is not None and inst.stall_limit_s is not None and inst.release_limit_s is not None \
                and stalled > inst.release_limit_s:
            self.suspect(inst, f"its engine owes progress for {stalled:.2f} s")

    def _recovering(self, inst: Instance, live: dict | None) -> bool:
        """A `/live` with `recovering_s`: the instance's model worker rebuilds what a lost attention
        server held, and no step of it ends before a replacement answers (seconds: the seed-1 Lamina
        soak kept new requests 8-10 s on it). With another instance that steps, it leaves routing now
        and its requests replay there; with none, it is suspect and keeps them. True when recovering."""
        seconds = live.get("recovering_s") if live else None
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
            return False
        why = f"its model worker has been rebuilding a lost attention server's KV for {seconds:.1f} s"
        if self.pools.has_alternative(inst):
            self.drop(inst, why)
        else:
            self.suspect(inst, why)
        return True

    def suspect(self, inst: Instance, why: str) -> None:
        """Mark `inst` suspect (new requests avoid it) and move its requests that showed the client
        nothing to an instance that steps, if one can take them; it stays in routing."""
        if not self.pools.is_healthy(inst.instance_id) or not self.pools.set_suspect(inst.instance_id, True):
            return
        movable = self.pools.has_alternative(inst)
        logger.warning("instance %s (%s) is suspect: %s (soft limit %.2f s, %d requests on it)%s", inst.url,
                       inst.pool.value, why, inst.release_limit_s or 0.0,
                       len(self.pools.scheduler.requests_on(inst.instance_id)),
                       ": moving those not started yet" if movable else "; no other instance can take them")
        if movable:
            for callback in self.on_suspect:
                callback(inst)


def _positive(value: object) -> float | None:
    """A `/live` duration: a positive number, else unknown."""
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
