# SPDX-License-Identifier: Apache-2.0
"""Event-driven Splitwise cluster simulator (Splitwise §IV-V, SplitwiseSim).

Routing is `vllm_disagg.router.policy.ClusterScheduler`, the same object the
HTTP router uses; batching is `machine.SimMachine` (the MLS); times come from
`perf_model.PerfModel`. Events: request arrival, iteration end, KV transfer
end. KV moves layer-wise for prompts of at least `layerwise_min_tokens`
tokens and serialized below (§IV-C, "<512 in H100").
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

import numpy as np

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec
from vllm_disagg.planner.machine import Batch, SimMachine, SimRequest
from vllm_disagg.planner.perf_model import PROMPT_TOKEN_CAP, build_perf_model
from vllm_disagg.planner.profile import Profile
from vllm_disagg.planner.traces import TraceRequest
from vllm_disagg.router.policy import ClusterScheduler, Pool, SchedulerConfig

KV_MEMORY_FRACTION = 0.9
"""Share of memory left after weights that holds KV (activations aside)."""


@dataclass(frozen=True)
class MachineGroup:
    """`count` machines of one hardware type in one pool."""

    hardware: HardwareSpec
    pool: Pool
    count: int


@dataclass
class SimOptions:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    layerwise_min_tokens: int = 512
    prompt_token_cap: int = PROMPT_TOKEN_CAP
    max_preemptions: int = 1
    chunked_prefill: bool = False
    """vLLM V1's rule instead of Splitwise's: fill `prompt_token_cap` (max_num_batched_tokens) with
    queued prompts, chunking the last one (see machine.py)."""
    max_sim_s: float | None = None
    """Stop (and report unfinished requests) after this simulated time."""
    seed: int = 0
    """Of the step-time draws (`Profile.step_jitter`); the same seed replays the same run."""
    shared_host: bool = False
    """The machines share one host's caches and memory (serve_predict's 1P+1D on one box): a decode step
    that starts while another machine computes a prompt step takes `decode_prefill_ratio` times its time."""
    first_token_on_decode: bool = False
    """Where a disaggregated request's first token comes from. Splitwise (§IV-C): the
    prompt machine samples it, so TTFT ends with the prompt phase. vLLM's P/D flow
    (pd_protocol.md): P's token is discarded and D samples the first token in its
    first iteration after the KV landed, so TTFT = prefill + visible transfer + one
    D iteration (in D's running batch)."""


@dataclass
class SimResult:
    requests: list[SimRequest]
    machines: list[SimMachine]
    end_s: float
    num_unfinished: int
    num_mixed_routes: int

    @property
    def completed(self) -> list[SimRequest]:
        return [r for r in self.requests if r.done_s is not None]

    def utilization(self) -> dict[str, float]:
        span = self.end_s or 1.0
        return {m.machine_id: m.busy_time_s / span for m in self.machines}


def kv_capacity_tokens(model: ModelSpec, hw: HardwareSpec) -> int:
    free = hw.mem_gb * 1e9 - model.weight_bytes
    return max(1, int(free * KV_MEMORY_FRACTION / model.kv_bytes_per_token))


class ClusterSim:
    """One simulation run over a fixed cluster."""

    def __init__(self, model: ModelSpec, groups: list[MachineGroup],
                 options: SimOptions | None = None, profile: Profile | None = None):
        self.options = options or SimOptions()
        self.scheduler = ClusterScheduler(self.options.scheduler, clock=lambda: self.now)
        self.machines: dict[str, SimMachine] = {}
        for g_idx, group in enumerate(groups):
            perf = build_perf_model(model, group.hardware, profile)
            cap = kv_capacity_tokens(model, group.hardware)
            for i in range(group.count):
                mid = f"{group.pool.value[0]}{g_idx}-{i}"
                self.machines[mid] = SimMachine(mid, perf, cap, self.options.prompt_token_cap,
                                                self.options.max_preemptions,
                                                self.options.chunked_prefill)
                self.scheduler.add_instance(mid, group.pool, kv_capacity_tokens=cap)
        self._events: list = []
        self._seq = itertools.count()
        self._jitter = profile.step_jitter if profile is not None else None
        self._prefill_jitter = profile.prefill_step_jitter if profile is not None else None
        self._rng = random.Random(self.options.seed)
        self.now = 0.0
        self.num_mixed_routes = 0

    # ------------------------------------------------------------- driving
    def run(self, trace: list[TraceRequest]) -> SimResult:
        reqs = [SimRequest(t) for t in trace]
        for req in reqs:
            self._push(req.trace.arrival_s, self._on_arrival, req)
        limit = self.options.max_sim_s
        while self._events:
            t, _, fn, arg = heapq.heappop(self._events)
            if limit is not None and t > limit:
                break
            self.now = t
            fn(arg)
        unfinished = sum(r.done_s is None for r in reqs)
        return SimResult(reqs, list(self.machines.values()), self.now, unfinished,
                         self.num_mixed_routes)

    def _push(self, t: float, fn, arg) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, arg))

    # -------------------------------------------------------------- events
    def _on_arrival(self, req: SimRequest) -> None:
        t = req.trace
        decision = self.scheduler.pick(t.req_id, t.num_prompt_tokens,
                                       max(0, t.num_output_tokens - 1))
        self.num_mixed_routes += decision.prefill_via_mixed or decision.decode_via_mixed
        req.prefill_id, req.decode_id = decision.prefill, decision.decode
        machine = self.machines[decision.prefill]
        machine.prefill_queue.append(req)
        self._kick(machine)

    def _kick(self, machine: SimMachine) -> None:
        if machine.busy:
            return
        batch = machine.next_batch()
        if batch is None:
            return
        duration = batch.duration_s * (self._step_factor(machine) if batch.num_prompt_tokens == 0 else 1.0)
        machine.busy_until_s = self.now + duration
        machine.computing_prompt = batch.num_prompt_tokens > 0
        machine.busy_time_s += duration
        self._push(machine.busy_until_s, self._on_iteration_done, (machine, batch))

    def _step_factor(self, machine: SimMachine) -> float:
        """One decode step's time over its curve's (a median): drawn from the spread measured on decode
        gaps. Prompt steps keep their curve's time: a gap's spread is not a long compute step's. Beside
        a host-mate's prompt step (`SimOptions.shared_host`), from the spread measured there where the
        profile has it, else the idle spread times `decode_prefill_ratio`."""
        beside = self.options.shared_host and any(
            m.computing_prompt for m in self.machines.values() if m is not machine)
        if beside and self._prefill_jitter is not None:
            return self._draw(self._prefill_jitter)
        ratio = machine.perf.decode_prefill_ratio if beside else 1.0
        return ratio * (self._draw(self._jitter) if self._jitter is not None else 1.0)

    def _draw(self, jitter: tuple[tuple[float, ...], tuple[float, ...]]) -> float:
        qs, ratios = jitter
        return float(np.interp(self._rng.random(), qs, ratios))

    def _on_iteration_done(self, arg: tuple[SimMachine, Batch]) -> None:
        machine, batch = arg
        machine.busy_until_s = None
        machine.computing_prompt = False
        for req in batch.prompts:
            self._prefill_done(machine, req)
        for req in batch.decodes:
            self._token_done(machine, req)
        self._kick(machine)

    def _prefill_done(self, machine: SimMachine, req: SimRequest) -> None:
        self.scheduler.on_prefill_done(req.req_id)
        if self.options.first_token_on_decode and req.decode_id != machine.machine_id:
            self._push_kv(machine, req)  # D samples token 1 (see SimOptions)
            return
        req.first_token_s = self.now
        req.num_generated = 1
        req.token_times_s.append(self.now)
        if req.decode_id == machine.machine_id:
            if req.finished:
                machine.num_kv_tokens -= req.num_kv_tokens
                self._finish(req)
            else:
                machine.running.append(req)
            return
        if req.finished:  # single-token request: no KV needs to move
            machine.release_prompt_kv(req)
            self._finish(req)
            return
        self._push_kv(machine, req)

    def _push_kv(self, machine: SimMachine, req: SimRequest) -> None:
        n = req.trace.num_prompt_tokens
        layerwise = n >= self.options.layerwise_min_tokens
        delay = machine.perf.kv_visible_ms(n, layerwise) / 1e3
        self._push(self.now + delay, self._on_kv_arrived, (machine, req))

    def _on_kv_arrived(self, arg: tuple[SimMachine, SimRequest]) -> None:
        src, req = arg
        src.release_prompt_kv(req)
        self._kick(src)
        dst = self.machines[req.decode_id]
        dst.decode_waiting.append(req)
        self._kick(dst)

    def _token_done(self, machine: SimMachine, req: SimRequest) -> None:
        req.num_generated += 1
        if req.first_token_s is None:
            req.first_token_s = self.now
        req.token_times_s.append(self.now)
        self.scheduler.on_decode_progress(req.req_id, 1)
        if req.finished:
            machine.finish_decode(req)
            self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        req.done_s = self.now
        self.scheduler.on_request_done(req.req_id)


def simulate(model: ModelSpec, groups: list[MachineGroup], trace: list[TraceRequest],
             options: SimOptions | None = None, profile: Profile | None = None) -> SimResult:
    """Convenience wrapper: build a cluster, run the trace, return the result."""
    return ClusterSim(model, groups, options, profile).run(trace)
