# SPDX-License-Identifier: Apache-2.0
"""Pool membership of the router: which instances exist, where their KV side channels are, which are up.

The routing *decision* is `vllm_disagg.router.policy.ClusterScheduler` (Splitwise's CLS, shared with the
planner's simulator). This module only maps its instance ids to HTTP/KV addresses, turns a decision
into a `Route` the proxy can execute, and keeps the Prometheus gauges in step.

Lifecycle per request: `route()` -> (`prefill_done()`) -> `done()`; health: `set_healthy()`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.metrics import RouterMetrics
from vllm_disagg.router.policy import ClusterScheduler, Pool, SchedulerConfig


@dataclass
class Instance:
    """One vLLM server as the router sees it."""

    instance_id: str
    pool: Pool
    url: str
    kv_host: str | None = None
    kv_port: int | None = None
    num_failed_checks: int = 0
    seen_healthy: bool = False
    """Passed a health check once: until then one failed check drops it (an instance still starting)."""
    last_progress: float = field(default_factory=time.monotonic)
    """Monotonic time the instance last showed progress (a good poll, its engine's step, a relayed token)."""
    stall_limit_s: float | None = None
    """This instance's adaptive stall limit from its last `/live` (None: `stall_timeout_s`)."""
    release_limit_s: float | None = None
    """Its soft stall limit: past it the instance is suspect (None: adaptive detection is off)."""
    expected_step_s: float | None = None
    """How long its step in progress should take, from its last `/live` (None: unknown)."""
    expected_progress_s: float | None = None
    """How long its next sign of progress should take: the step's, or one layer's share of it while the
    step's layers report (`/live`'s `expected_progress_s`; an instance without it: `expected_step_s`)."""
    idle_at: float = 0.0
    """Monotonic time the stall watchdog last saw nothing booked here: it owes no progress before."""
    has_live: bool | None = None
    """Whether it serves `/live` (vllm_disagg/liveness/); None until asked."""
    live_asked_at: float = 0.0
    poll_sent_at: float | None = None
    """Monotonic time the health poll in flight was sent (None: none in flight)."""


@dataclass(frozen=True)
class Route:
    """What the proxy does with one request.

    `prefill` is set for the P/D push path; None means `target` serves the whole request.
    `reason` says why a request did not take the push path (for the fallback counter)."""

    req_id: str
    target: Instance
    prefill: Instance | None = None
    reason: str | None = None

    @property
    def kind(self) -> str:
        return "pd" if self.prefill is not None else "plain"


class InstancePools:
    """Instances by id (their URL) plus the shared CLS that picks among them."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 scheduler_config: SchedulerConfig | None = None) -> None:
        self.metrics = metrics
        self.static = not config.dynamic_membership
        self.scheduler = ClusterScheduler(scheduler_config or SchedulerConfig())
        self.instances: dict[str, Instance] = {}
        kv_addrs = config.prefill_kv or [None] * len(config.prefill_urls)  # vLLM's protocol: no KV address
        for url, kv in zip(config.prefill_urls, kv_addrs, strict=True):
            host, _, port = (kv or "").rpartition(":")
            self._add(Instance(_norm(url), Pool.PREFILL, _norm(url), host or None, int(port) if port else None))
        for url in config.decode_urls:
            self._add(Instance(_norm(url), Pool.DECODE, _norm(url)))
        for url in config.mixed_urls:
            self._add(Instance(_norm(url), Pool.MIXED, _norm(url)))
        self.update_gauges()

    def _add(self, inst: Instance) -> None:
        if inst.instance_id in self.instances:
            raise ValueError(f"instance {inst.url} given twice")
        self.instances[inst.instance_id] = inst
        self.scheduler.add_instance(inst.instance_id, inst.pool)

    # ------------------------------------------------------------ routing
    def route(self, num_prompt_tokens: int, num_decode_tokens: int, allow_pd: bool = True) -> Route:
        """Ask the CLS for a (prefill, decode) pair; raises NoHealthyInstanceError when none is up."""
        req_id = uuid.uuid4().hex
        decision = self.scheduler.pick(req_id, num_prompt_tokens, num_decode_tokens)
        pre = self.instances[decision.prefill]
        dec = self.instances[decision.decode]
        if decision.colocated:
            reason = None if pre.pool is Pool.MIXED else "mixed_pool"
            route = Route(req_id, dec, reason=reason)
        elif pre.pool is Pool.PREFILL and dec.pool is Pool.DECODE and allow_pd:
            route = Route(req_id, dec, prefill=pre)
        else:
            # Only P->D pairs can push KV (connector roles); the decode side serves it whole.
            self.scheduler.on_prefill_done(req_id)
            route = Route(req_id, dec, reason="pair_cannot_push" if allow_pd else "not_pushable")
        self.update_gauges()
        return route

    def prefill_done(self, req_id: str) -> None:
        self.scheduler.on_prefill_done(req_id)
        self.update_gauges()

    def decode_progress(self, req_id: str, num_tokens: int = 1) -> None:
        self.scheduler.on_decode_progress(req_id, num_tokens)

    def done(self, req_id: str) -> None:
        self.scheduler.on_request_done(req_id)
        self.update_gauges()

    # ------------------------------------------------------------- health
    def set_healthy(self, instance_id: str, healthy: bool) -> bool:
        """Record a health verdict; True when it changed the instance's membership.

        Ids discovery has already removed are ignored (a poll may finish after the removal)."""
        state = self.scheduler.instances.get(instance_id)
        if state is None:
            return False
        if state.healthy == healthy:
            return False
        if healthy:
            self.scheduler.mark_healthy(instance_id)
        else:
            self.scheduler.mark_unhealthy(instance_id)
        self.update_gauges()
        return True

    def num_booked(self, instance_id: str) -> int:
        """Requests whose prefill or decode the router booked on this instance and that are not over."""
        state = self.scheduler.instances.get(instance_id)
        return 0 if state is None else state.num_prefill_reqs + state.num_decode_reqs

    def set_suspect(self, instance_id: str, suspect: bool) -> bool:
        """Mark an instance that owes progress past its soft limit; True when that changed."""
        state = self.scheduler.instances.get(instance_id)
        if state is None or state.suspect == suspect:
            return False
        state.suspect = suspect
        return True

    def is_suspect(self, instance_id: str) -> bool:
        state = self.scheduler.instances.get(instance_id)
        return state is not None and state.suspect

    def has_alternative(self, inst: Instance) -> bool:
        """Another healthy instance that shows progress could take this one's requests (one of the
        other pool serves a request whole, policy.ClusterScheduler._steady)."""
        return any(s.healthy and not s.suspect and iid != inst.instance_id
                   for iid, s in self.scheduler.instances.items())

    def is_healthy(self, instance_id: str) -> bool:
        return self.scheduler.instances[instance_id].healthy

    def healthy_instances(self) -> list[Instance]:
        return [i for i in self.instances.values() if self.is_healthy(i.instance_id)]

    def starting(self) -> bool:
        """Some pool of a static deployment has members and none ever passed a health check: it is still
        coming up (by hand, D may be up before P), and /health answers 503. Discovery (Kubernetes, Ray)
        adds members once they are ready. An instance up whose engine has stepped (`/live` knows its
        step time) says the deployment is not coming up: a router restarted while another instance
        restarts. Its requests then go where they can at once; they waited for the dead instance's
        first health check (9.7 s in the Lamina chaos soak, seed 2)."""
        if not self.static or any(i.expected_step_s is not None for i in self.healthy_instances()):
            return False
        pools = {i.pool for i in self.instances.values()}
        return bool(pools - {i.pool for i in self.instances.values() if i.seen_healthy})

    def any_healthy(self) -> Instance | None:
        """For endpoints any instance can answer (/v1/models): decode/mixed first."""
        order = {Pool.DECODE: 0, Pool.MIXED: 1, Pool.PREFILL: 2}
        live = sorted(self.healthy_instances(), key=lambda i: order[i.pool])
        return live[0] if live else None

    def snapshot(self) -> list[dict]:
        """Per-instance state for /health and logs."""
        out = []
        for inst in self.instances.values():
            s = self.scheduler.instances[inst.instance_id]
            out.append({"url": inst.url, "pool": inst.pool.value, "healthy": s.healthy,
                        "in_mixed_pool": s.in_mixed_pool, "pending_tokens": s.num_pending_tokens,
                        "prompt_tokens_per_s": s.prompt_rate.tokens_per_s, "prompt_queue_s": s.prompt_queue_s,
                        "kv": f"{inst.kv_host}:{inst.kv_port}" if inst.kv_host else None})
        return out

    def update_gauges(self) -> None:
        m = self.metrics
        for pool in Pool:
            states = [s for s in self.scheduler.instances.values() if s.pool is pool]
            reqs = sum(s.num_prefill_reqs if pool is Pool.PREFILL else s.num_decode_reqs for s in states)
            m.queue_requests.labels(pool.value).set(reqs)
            m.queue_tokens.labels(pool.value).set(sum(s.num_pending_tokens for s in states))
        for inst in self.instances.values():
            s = self.scheduler.instances[inst.instance_id]
            m.instance_pending_tokens.labels(inst.pool.value, inst.url).set(s.num_pending_tokens)
            m.instance_prompt_queue_s.labels(inst.pool.value, inst.url).set(s.prompt_queue_s or 0.0)
            m.instance_healthy.labels(inst.pool.value, inst.url).set(1 if s.healthy else 0)


def _norm(url: str) -> str:
    return url.rstrip("/")
