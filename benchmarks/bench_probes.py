# SPDX-License-Identifier: Apache-2.0
"""Measuring helpers shared by attn_bench.py and nano_bench.py: core placement, per-engine timers.

The engines of a run live in this process (in-process engine cores) and take turns, so one set of
timers serves them all: `Probes.engine` names the engine whose turn it is. The timers wrap, in this
process only:
- the runner's `_model_forward` (forward time; the rest of `engine.step()` is vLLM's scheduler,
  input preparation, sampling and output processing),
- vLLM's CPU attention impl (local attention kernel time, plain engines),
- the remote attention client's `PendingAttention.wait` (time blocked on attention replies) and its
  message sends and replies (first send and last reply of each forward: the pipeline's fill and drain).
The attention servers' kernel time comes from their own Prometheus `/metrics`.
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
from collections import defaultdict
from contextlib import contextmanager

import torch

BOTH_CORES, MODEL_CORE, ATTENTION_CORE = {0, 1}, 0, 1
_SET_NUM_THREADS = torch.set_num_threads  # before any vLLM CPU worker replaces it with a no-op


_ALLOWED = frozenset(os.sched_getaffinity(0))  # before any placement narrows this thread's mask


def can_pin() -> bool:
    return len(_ALLOWED) >= 2 and BOTH_CORES <= _ALLOWED


def pin_process(cpus: set[int], pid: int = 0) -> None:
    """Pin every thread of `pid` (0: this process); threads spawned later inherit their creator's mask."""
    pid = pid or os.getpid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass


def set_threads(num: int) -> None:
    """OpenMP width of this thread's kernels (vLLM's CPU worker replaces torch.set_num_threads with a
    no-op once it has bound its threads; in-process engines here bind nothing)."""
    _SET_NUM_THREADS(num)


@contextmanager
def placed(cpus: set[int], threads: int):
    """This process's threads on `cpus`, kernels `threads` wide, for the duration of a turn."""
    if can_pin():
        pin_process(cpus)
    set_threads(threads)
    try:
        yield
    finally:
        if can_pin():
            pin_process(BOTH_CORES)


def server_seconds(http: str) -> tuple[float, float]:
    """(kernel, busy): seconds an attention server has spent in its kernel (KV write + attention, all
    layers) and handling messages at all (frame checks, kernel, reply) so far, from its /metrics."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()

    def total(prefix: str) -> float:
        return sum(float(x.split()[-1]) for x in lines if x.startswith(prefix))

    return total("vllm:disagg_attention_layer_seconds_sum"), total("vllm:disagg_attention_busy_seconds_total")


class Probes:
    """Accumulating timers per engine name (see the module docstring); `install()` once per process."""

    def __init__(self) -> None:
        self.engine = ""
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._fwd_start = self._first_send = self._last_reply = None
        self.last_num_tokens = 0
        """Tokens in the latest forward (a step is decode-only when each of them made an output)."""

    def add(self, key: str, value: float) -> None:
        self.totals[self.engine][key] += value

    def install(self) -> None:
        from vllm.v1.attention.backends import cpu_attn

        from vllm_disagg.attention import client as attn_client

        probes = self
        attn_forward = cpu_attn.CPUAttentionBackendImpl.forward

        def timed_attention(impl, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attn_forward(impl, *args, **kwargs)
            finally:
                probes.add("local_attention_s", time.perf_counter() - t0)

        cpu_attn.CPUAttentionBackendImpl.forward = timed_attention
        wait = attn_client.PendingAttention.wait

        def timed_wait(pending, output):
            t0 = time.perf_counter()
            try:
                return wait(pending, output)
            finally:
                now = time.perf_counter()
                probes.add("wait_s", now - t0)
                probes._last_reply = now

        attn_client.PendingAttention.wait = timed_wait
        send = attn_client.ServerConn.send

        def counted_send(conn, mtype, *args, **kwargs):
            if mtype in (attn_client.wire.ATTN, attn_client.wire.QPREV):
                probes.add("messages", 1)
                if probes._first_send is None:
                    probes._first_send = time.perf_counter()
            return send(conn, mtype, *args, **kwargs)

        attn_client.ServerConn.send = counted_send

    def watch_runner(self, runner) -> None:
        """Time `runner._model_forward` (outermost: recovery and nano-batching included)."""
        forward = runner._model_forward
        probes = self

        def timed_forward(*args, **kwargs):
            ids = args[0] if args else kwargs.get("input_ids")
            pos = args[1] if len(args) > 1 else kwargs.get("positions")
            probes.last_num_tokens = int((ids if ids is not None else pos).shape[-1])
            probes._fwd_start, probes._first_send, probes._last_reply = time.perf_counter(), None, None
            try:
                return forward(*args, **kwargs)
            finally:
                end = time.perf_counter()
                probes.add("forward_s", end - probes._fwd_start)
                probes.add("forwards", 1)
                if probes._first_send is not None and probes._last_reply is not None:
                    probes.add("fill_s", probes._first_send - probes._fwd_start)
                    probes.add("drain_s", end - probes._last_reply)

        runner._model_forward = timed_forward


_PROBES: Probes | None = None


def probes() -> Probes:
    """This process's probes, installed once (the wrappers are class-level), totals cleared."""
    global _PROBES
    if _PROBES is None:
        _PROBES = Probes()
        _PROBES.install()
    _PROBES.totals.clear()
    return _PROBES


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def per_step_breakdown(totals: dict[str, float], steps: int, step_ms: float, server_s: tuple[float, float] | None,
                       pipelined: bool) -> dict[str, float]:
    """Where one step's time goes (ms, means over the timed steps); the parts add up to the step.

    - vllm_outside_forward: scheduler, input preparation, sampling, output processing;
    - dense: the model worker's own compute (serial configurations);
    - attention: vLLM's CPU kernel, locally or on the attention server (KV write included);
    - wire: the exchange around the server's kernel; serial: the time waited for replies minus the
      kernel (transport, the server's per-message work, the client's packing and wake-ups);
      pipelined: the server's busy time minus its kernel (frame checks, step metadata, reply);
    - waits (pipelined): the rest of the forward, where the server sits idle: waiting for the model
      worker's dense work between messages, and the transport's latency;
    - fill_drain (pipelined): forward start to the first request sent, last reply to forward end."""
    n = max(steps, 1)
    ms = {k: v / n * 1e3 for k, v in totals.items() if k.endswith("_s")}
    forward = ms.get("forward_s", 0.0)
    out = {"step": round(step_ms, 3), "vllm_outside_forward": max(step_ms - forward, 0.0)}
    if server_s is None:  # plain vLLM: attention in the engine
        attention = ms.get("local_attention_s", 0.0)
        out.update(dense=forward - attention, attention=attention)
    elif not pipelined:
        kernel, wait = server_s[0] / n * 1e3, ms.get("wait_s", 0.0)
        out.update(dense=forward - wait, attention=kernel, wire=max(wait - kernel, 0.0))
    else:
        kernel, busy = server_s[0] / n * 1e3, server_s[1] / n * 1e3
        fill_drain = ms.get("fill_s", 0.0) + ms.get("drain_s", 0.0)
        out.update(attention=kernel, wire=max(busy - kernel, 0.0), fill_drain=fill_drain,
                   waits=max(forward - busy - fill_drain, 0.0))
        out["server_idle_share_of_forward"] = max(forward - busy, 0.0) / max(forward, 1e-9)
    out["messages_per_step"] = totals.get("messages", 0) / n
    return {k: round(v, 3) for k, v in out.items()}


def median_ratio(num: list[float], den: list[float]) -> float:
    """Median over paired samples of num/den."""
    return statistics.median(a / b for a, b in zip(num, den))


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
