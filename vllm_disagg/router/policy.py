# SPDX-License-Identifier: Apache-2.0
"""Splitwise's cluster-level scheduler (CLS) as pure logic, no I/O.

Splitwise §IV-A: every request gets a *pair* of instances (prefill, decode),
chosen at the same time so the KV transfer can overlap the prompt phase.
Routing is Join-the-Shortest-Queue where queue length = pending tokens.
When the best instance of a pool is too loaded, the request goes to the
*mixed pool*; if the mixed pool is also full, an instance of the opposite
pool is moved into it. A mixed instance keeps its identity and goes home
once it has no work of the opposite kind left. "Too loaded" is, by default,
P's prompt queue in seconds of its measured prompt rate (prompt_rate.py):
past one limit P also decodes the request, past a higher one D prefills it.

More: README.md, "policy.py".
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_disagg.router.prompt_rate import PromptRate


class Pool(str, enum.Enum):
    """Home pool of an instance. MIXED instances serve both phases always
    (Splitwise's baselines: every machine runs mixed continuous batching)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class NoHealthyInstanceError(RuntimeError):
    """No healthy instance can take the request (both pools empty or dead)."""


@dataclass
class InstanceState:
    """What the CLS knows about one instance (machine or vLLM server)."""

    instance_id: str
    pool: Pool
    healthy: bool = True
    in_mixed_pool: bool = False
    num_pending_prefill_tokens: int = 0
    """Prompt tokens routed here whose prefill has not finished."""
    num_pending_decode_tokens: int = 0
    """Output tokens still to generate for requests decoding here."""
    kv_capacity_tokens: int | None = None
    """KV slots (tokens) of this instance; None = unbounded (not memory-aware)."""
    num_kv_tokens: int = 0
    """KV tokens reserved by requests assigned here (prompt + output)."""
    num_prefill_reqs: int = 0
    """Requests whose prefill is queued or running here."""
    num_decode_reqs: int = 0
    """Requests that will decode (or are decoding) here."""
    suspect: bool = False
    """Owes progress past its soft stall limit (router/health.py) but is not cut: chosen only when no
    instance that shows progress can take the request (the simulator never sets it)."""
    prompt_rate: PromptRate = field(default_factory=PromptRate)
    """Its measured prefill speed: turns its prompt queue into seconds."""

    @property
    def num_pending_tokens(self) -> int:
        return self.num_pending_prefill_tokens + self.num_pending_decode_tokens

    @property
    def prompt_queue_s(self) -> float | None:
        """Seconds its booked prompts take at its measured rate (None: not measured yet)."""
        return self.prompt_rate.seconds_for(self.num_pending_prefill_tokens)

    def kv_fits(self, num_tokens: int) -> bool:
        cap = self.kv_capacity_tokens
        return cap is None or self.num_kv_tokens + num_tokens <= cap


@dataclass(frozen=True)
class RoutingDecision:
    """The (prefill, decode) pair for one request."""

    req_id: str
    prefill: str
    decode: str
    prefill_via_mixed: bool = False
    decode_via_mixed: bool = False

    @property
    def colocated(self) -> bool:
        """Both phases on one instance: no KV transfer needed."""
        return self.prefill == self.decode


@dataclass
class _Assignment:
    decision: RoutingDecision
    num_prompt_tokens: int
    num_decode_tokens: int
    num_kv_tokens: int
    prefill_done: bool = False


@dataclass
class SchedulerConfig:
    """Knobs of the CLS (Splitwise §IV-A)."""

    prefill_queue_threshold: int | None = None
    """Pending prefill tokens above which a prompt goes to the mixed pool (None: no token limit)."""
    decode_queue_threshold: int | None = None
    """Pending decode tokens above which a request decodes in the mixed pool (None: no token limit)."""
    prefill_queue_s: float | None = 8.0
    """P's prompt queue, in seconds of its measured prompt rate, above which a prompt goes to the
    mixed pool (D prefills it). None: off."""
    colocate_queue_s: float | None = 4.0
    """P's prompt queue in seconds above which P keeps the request whole (decodes it too): its
    prompt waits that long anyway, and P's prefill steps carry its decode at little cost, so P's
    core decodes instead of idling once the burst's prompts are done. None: off."""


@dataclass
class ClusterScheduler:
    """JSQ-by-pending-tokens routing over prefill / decode / mixed pools."""

    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    instances: dict[str, InstanceState] = field(default_factory=dict)
    _assignments: dict[str, _Assignment] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    """Time for the prompt-rate measurement (the simulator passes its own)."""
    listeners: list[Callable[[str, bool, list[str]], None]] = field(default_factory=list)
    """Called as `(instance_id, healthy, lost_req_ids)` when an instance joins or comes back
    (healthy=True, no ids) or leaves routing (healthy=False, the requests booked on it)."""

    # ------------------------------------------------------------ membership
    def add_instance(self, instance_id: str, pool: Pool | str,
                     kv_capacity_tokens: int | None = None) -> InstanceState:
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id!r} already registered")
        inst = InstanceState(instance_id, Pool(pool), kv_capacity_tokens=kv_capacity_tokens)
        inst.in_mixed_pool = inst.pool is Pool.MIXED
        self.instances[instance_id] = inst
        self._notify(instance_id, True, [])
        return inst

    def mark_unhealthy(self, instance_id: str) -> list[str]:
        """Drop an instance from routing. Returns the req_ids that were on it;
        Splitwise §IV-E restarts them from scratch (caller calls `pick` again)."""
        inst = self.instances[instance_id]
        inst.healthy = inst.suspect = False
        lost = [rid for rid, a in self._assignments.items()
                if instance_id in (a.decision.prefill, a.decision.decode)]
        for rid in lost:
            self.on_request_done(rid)
        inst.in_mixed_pool = inst.pool is Pool.MIXED
        self._notify(instance_id, False, lost)
        return lost

    def requests_on(self, instance_id: str) -> list[str]:
        """The req_ids whose unfinished prefill, or whose decode, is booked on this instance."""
        return [rid for rid, a in self._assignments.items()
                if a.decision.decode == instance_id or (a.decision.prefill == instance_id and not a.prefill_done)]

    def mark_healthy(self, instance_id: str) -> None:
        inst = self.instances[instance_id]
        inst.healthy, inst.suspect = True, False
        self._notify(instance_id, True, [])

    def _notify(self, instance_id: str, healthy: bool, lost: list[str]) -> None:
        for listener in list(self.listeners):
            listener(instance_id, healthy, lost)

    def report_capacity(self, instance_id: str, kv_capacity_tokens: int | None) -> None:
        """Instances report memory capacity periodically (Splitwise §IV-A)."""
        self.instances[instance_id].kv_capacity_tokens = kv_capacity_tokens

    # --------------------------------------------------------------- routing
    def pick(self, req_id: str, num_prompt_tokens: int,
             num_decode_tokens: int = 1) -> RoutingDecision:
        """Assign (prefill, decode) instances to a request and book its load.

        `num_decode_tokens` is the expected output length (the simulator
        knows it; the HTTP router passes max_tokens or an estimate)."""
        if req_id in self._assignments:
            raise ValueError(f"request {req_id!r} already routed")
        prefill, p_mixed = self._choose_prefill(num_prompt_tokens)
        decode, d_mixed = self._choose_decode(prefill, num_prompt_tokens + num_decode_tokens)
        decision = RoutingDecision(req_id, prefill.instance_id, decode.instance_id,
                                   p_mixed, d_mixed)
        num_kv = num_prompt_tokens + num_decode_tokens
        if prefill.num_prefill_reqs == 0:
            prefill.prompt_rate.on_busy(self.clock())
        prefill.num_pending_prefill_tokens += num_prompt_tokens
        prefill.num_prefill_reqs += 1
        decode.num_pending_decode_tokens += num_decode_tokens
        decode.num_decode_reqs += 1
        decode.num_kv_tokens += num_kv
        self._assignments[req_id] = _Assignment(decision, num_prompt_tokens,
                                                num_decode_tokens, num_kv)
        return decision

    def on_prefill_done(self, req_id: str) -> None:
        """The prompt phase finished (first token out, KV shipped)."""
        a = self._assignments.get(req_id)
        if a is None or a.prefill_done:
            return
        a.prefill_done = True
        inst = self.instances[a.decision.prefill]
        inst.prompt_rate.on_prefill_done(a.num_prompt_tokens, self.clock())
        self._release_prompt(inst, a.num_prompt_tokens)
        self._maybe_go_home(inst)

    def on_decode_progress(self, req_id: str, num_tokens: int = 1) -> None:
        """`num_tokens` more output tokens were generated (optional updates)."""
        a = self._assignments.get(req_id)
        if a is None:
            return
        step = min(num_tokens, a.num_decode_tokens)
        a.num_decode_tokens -= step
        self.instances[a.decision.decode].num_pending_decode_tokens -= step

    def on_request_done(self, req_id: str) -> None:
        """Finished, aborted or failed: release everything booked for it."""
        a = self._assignments.pop(req_id, None)
        if a is None:
            return
        if not a.prefill_done:
            self._release_prompt(self.instances[a.decision.prefill], a.num_prompt_tokens)
        dec = self.instances[a.decision.decode]
        dec.num_pending_decode_tokens -= a.num_decode_tokens
        dec.num_decode_reqs -= 1
        dec.num_kv_tokens -= a.num_kv_tokens
        for iid in {a.decision.prefill, a.decision.decode}:
            self._maybe_go_home(self.instances[iid])

    def assignment(self, req_id: str) -> RoutingDecision | None:
        a = self._assignments.get(req_id)
        return None if a is None else a.decision

    @property
    def num_active_requests(self) -> int:
        return len(self._assignments)

    # -------------------------------------------------------------- internals
    @staticmethod
    def _release_prompt(inst: InstanceState, num_prompt_tokens: int) -> None:
        inst.num_pending_prefill_tokens -= num_prompt_tokens
        inst.num_prefill_reqs -= 1
        if inst.num_prefill_reqs == 0:
            inst.prompt_rate.on_idle()

    def _prompts_full(self, inst: InstanceState) -> bool:
        """The prompt queue is past the token limit or the seconds limit (an unmeasured rate: no)."""
        tokens, seconds = self.config.prefill_queue_threshold, self.config.prefill_queue_s
        queue_s = inst.prompt_queue_s
        return ((tokens is not None and inst.num_pending_prefill_tokens >= tokens)
                or (seconds is not None and queue_s is not None and queue_s > seconds))

    def _decodes_full(self, inst: InstanceState) -> bool:
        limit = self.config.decode_queue_threshold
        return limit is not None and inst.num_pending_decode_tokens >= limit

    def _keeps_whole(self, prefill: InstanceState, num_kv_tokens: int) -> bool:
        """A P whose prompt queue is past `colocate_queue_s` also decodes the request."""
        limit, queue_s = self.config.colocate_queue_s, prefill.prompt_queue_s
        return (prefill.pool is Pool.PREFILL and limit is not None and queue_s is not None
                and queue_s > limit and prefill.kv_fits(num_kv_tokens))

    def _healthy(self, pool: Pool) -> list[InstanceState]:
        return [i for i in self.instances.values() if i.healthy and i.pool is pool]

    def _mixed_pool(self) -> list[InstanceState]:
        return [i for i in self.instances.values() if i.healthy and i.in_mixed_pool]

    @staticmethod
    def _jsq(cands: list[InstanceState]) -> InstanceState | None:
        # min() keeps registration order on ties: deterministic routing.
        return min(cands, key=lambda i: (i.suspect, i.num_pending_tokens), default=None)

    def _choose_prefill(self, num_tokens: int) -> tuple[InstanceState, bool]:
        # Home instances serve their own phase even while lent to the mixed
        # pool; baseline (MIXED) machines take prompts directly.
        home = self._healthy(Pool.PREFILL) + self._healthy(Pool.MIXED)
        best = self._jsq(home)
        if best is not None and best.suspect and (steady := self._steady(Pool.DECODE, lambda i: True)):
            return steady
        if best is not None and (best.pool is Pool.MIXED or not self._prompts_full(best)):
            return best, False
        return self._overflow(best, Pool.DECODE, self._prompts_full, lambda i: True)

    def _choose_decode(self, prefill: InstanceState,
                       num_kv_tokens: int) -> tuple[InstanceState, bool]:
        if prefill.pool is Pool.MIXED:
            return prefill, False  # baseline machines keep the whole request
        if self._keeps_whole(prefill, num_kv_tokens):
            prefill.in_mixed_pool = True
            return prefill, True
        fits = lambda i: i.kv_fits(num_kv_tokens)  # noqa: E731
        home = [i for i in self._healthy(Pool.DECODE) if fits(i)]
        best = self._jsq(home)
        if best is not None and best.suspect and (steady := self._steady(Pool.PREFILL, fits)):
            return steady
        if best is not None and not self._decodes_full(best):
            return best, False
        return self._overflow(best, Pool.PREFILL, self._decodes_full, fits)

    def _steady(self, opposite: Pool, fits) -> tuple[InstanceState, bool] | None:
        """Every home instance is suspect (owes progress): borrow one of the opposite pool, or a
        mixed one, that shows progress; it serves the request whole. None: all are suspect."""
        cand = self._jsq([i for i in self._healthy(opposite) + self._mixed_pool() if not i.suspect and fits(i)])
        if cand is None:
            return None
        if cand.pool is opposite:
            cand.in_mixed_pool = True
        return cand, cand.pool is opposite

    def _overflow(self, best, opposite: Pool, full, fits) -> tuple[InstanceState, bool]:
        """Splitwise §IV-A overflow: mixed pool first, then borrow from the
        opposite pool; fall back to the (overloaded) home best if neither.
        `best` is None or full (`full(best)` is true)."""
        if best is not None:
            mixed = [i for i in self._mixed_pool() if not full(i) and fits(i)]
            cand = self._jsq(mixed)
            if cand is not None:
                return cand, cand.pool is opposite
            borrow = self._jsq([i for i in self._healthy(opposite)
                                if not i.in_mixed_pool and fits(i)])
            if borrow is not None:
                borrow.in_mixed_pool = True
                return borrow, True
            return best, False
        cand = self._jsq([i for i in self._mixed_pool() if fits(i)])
        if cand is None:
            cand = self._jsq([i for i in self._healthy(opposite) if fits(i)])
        if cand is None:  # nothing has room now: queue on the least-loaded home instance
            home = Pool.PREFILL if opposite is Pool.DECODE else Pool.DECODE
            cand = self._jsq(self._healthy(home)) or self._jsq(self._mixed_pool())
        if cand is None:
            raise NoHealthyInstanceError("no healthy instance can serve this request")
        if cand.pool is not Pool.MIXED and cand.pool is opposite:
            cand.in_mixed_pool = True
        return cand, cand.pool is opposite

    def _maybe_go_home(self, inst: InstanceState) -> None:
        """A borrowed instance returns once no opposite-kind work is pending."""
        if not inst.in_mixed_pool or inst.pool is Pool.MIXED:
            return
        opposite = inst.num_decode_reqs if inst.pool is Pool.PREFILL else inst.num_prefill_reqs
        if opposite <= 0:
            inst.in_mixed_pool = False
