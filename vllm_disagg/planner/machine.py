# SPDX-License-Identifier: Apache-2.0
"""Splitwise's machine-level scheduler (MLS, §IV-B) for the simulator.

More: README.md, "machine.py".
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vllm_disagg.planner.perf_model import PROMPT_TOKEN_CAP, PerfModel
from vllm_disagg.planner.traces import TraceRequest


@dataclass(eq=False)
class SimRequest:
    """A trace request plus the times the simulator records for it."""

    trace: TraceRequest
    prefill_id: str = ""
    decode_id: str = ""
    num_generated: int = 0
    num_preemptions: int = 0
    first_token_s: float | None = None
    done_s: float | None = None
    kv_on_decode: bool = False
    num_prefilled: int = 0
    """Prompt tokens already computed (chunked prefill)."""
    joined: bool = False
    """Its pushed KV has joined a decode batch (the step it joined in pays `decode_join_ms`)."""
    token_times_s: list[float] = field(default_factory=list)
    """When each output token came out (every gap, for goodput.py)."""

    @property
    def req_id(self) -> str:
        return self.trace.req_id

    @property
    def num_kv_tokens(self) -> int:
        return self.trace.num_prompt_tokens + self.trace.num_output_tokens

    @property
    def num_context_tokens(self) -> int:
        return self.trace.num_prompt_tokens + self.num_generated

    @property
    def finished(self) -> bool:
        return self.num_generated >= self.trace.num_output_tokens


@dataclass
class Batch:
    """One iteration: prompts to prefill and decodes to advance one token."""

    prompts: list[SimRequest]
    """Prompts whose prefill completes in this iteration."""
    decodes: list[SimRequest]
    duration_s: float
    num_prompt_tokens: int = 0
    """Prompt tokens computed in this iteration (chunks included)."""


@dataclass(eq=False)
class SimMachine:
    machine_id: str
    perf: PerfModel
    kv_capacity_tokens: int
    prompt_token_cap: int = PROMPT_TOKEN_CAP
    max_preemptions: int = 1
    chunked_prefill: bool = False
    prefill_queue: deque = field(default_factory=deque)
    decode_waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    num_kv_tokens: int = 0
    busy_until_s: float | None = None
    computing_prompt: bool = False
    """Its current iteration computes prompt tokens (a host-mate's decode steps slow down meanwhile)."""
    busy_time_s: float = 0.0
    num_iterations: int = 0
    num_mixed_iterations: int = 0

    @property
    def busy(self) -> bool:
        return self.busy_until_s is not None

    def has_work(self) -> bool:
        return bool(self.prefill_queue or self.decode_waiting or self.running)

    # ------------------------------------------------------------ batching
    def next_batch(self) -> Batch | None:
        """Pick the next iteration's batch (None if idle)."""
        num_joined = self._admit_decodes()
        chunks = self._take_chunks() if self.chunked_prefill else [
            (r, r.trace.num_prompt_tokens) for r in self._take_prompts()]
        decodes = list(self.running)
        if not chunks and not decodes:
            return None
        ctx = sum(r.num_context_tokens for r in decodes)
        num_prompt_tokens = sum(m for _, m in chunks)
        ms = self.perf.mixed_ms(num_prompt_tokens, len(decodes), ctx, [m for _, m in chunks],
                                [r.num_prefilled for r, _ in chunks])
        ms += self.perf.decode_join_ms * num_joined
        done = []
        for req, m in chunks:
            req.num_prefilled += m
            if req.num_prefilled >= req.trace.num_prompt_tokens:
                done.append(req)
        if chunks and decodes:
            self.num_mixed_iterations += 1
        self.num_iterations += 1
        return Batch(done, decodes, ms / 1e3, num_prompt_tokens)

    def _admit_decodes(self) -> int:
        """Move waiting decodes into the batch while KV fits; how many joined for the first time."""
        num_joined = 0
        while self.decode_waiting:
            req = self.decode_waiting[0]
            need = 0 if req.kv_on_decode else req.num_kv_tokens
            if self.running and self.num_kv_tokens + need > self.kv_capacity_tokens:
                break  # queue tokens while memory is short (§IV-B)
            self.decode_waiting.popleft()
            self.num_kv_tokens += need
            req.kv_on_decode = True
            num_joined += not req.joined
            req.joined = True
            self.running.append(req)
        return num_joined

    def _take_prompts(self) -> list[SimRequest]:
        taken: list[SimRequest] = []
        total = 0
        while self.prefill_queue:
            req = self.prefill_queue[0]
            n = req.trace.num_prompt_tokens
            if taken and total + n > self.prompt_token_cap:
                break
            need = self._prompt_kv(req)
            if self.num_kv_tokens + need > self.kv_capacity_tokens and not self._preempt_for(need):
                if taken or self.running:
                    break
            self.prefill_queue.popleft()
            self.num_kv_tokens += need
            taken.append(req)
            total += n
        return taken

    def _take_chunks(self) -> list[tuple[SimRequest, int]]:
        """vLLM V1: fill `prompt_token_cap` (max_num_batched_tokens) FCFS, chunking the last prompt;
        a partly prefilled prompt stays at the head of the queue (its KV already held). Running
        decodes are scheduled first and take one token of the budget each."""
        taken: list[tuple[SimRequest, int]] = []
        budget = self.prompt_token_cap - len(self.running)
        for req in list(self.prefill_queue):
            if budget <= 0:
                break
            if req.num_prefilled == 0:
                need = self._prompt_kv(req)
                if self.num_kv_tokens + need > self.kv_capacity_tokens and not self._preempt_for(need):
                    if taken or self.running:
                        break
                self.num_kv_tokens += need
            m = min(budget, req.trace.num_prompt_tokens - req.num_prefilled)
            taken.append((req, m))
            budget -= m
            if req.num_prefilled + m >= req.trace.num_prompt_tokens:
                self.prefill_queue.remove(req)
        return taken

    def _prompt_kv(self, req: SimRequest) -> int:
        """Colocated requests keep their KV here for the whole request."""
        if req.decode_id == self.machine_id:
            req.kv_on_decode = True
            return req.num_kv_tokens
        return req.trace.num_prompt_tokens

    def _preempt_for(self, need: int) -> bool:
        """Free memory by pushing the youngest decodes back to the wait queue."""
        victims = [r for r in reversed(self.running) if r.num_preemptions < self.max_preemptions]
        for req in victims:
            if self.num_kv_tokens + need <= self.kv_capacity_tokens:
                break
            self.running.remove(req)
            req.num_preemptions += 1
            req.kv_on_decode = False
            self.num_kv_tokens -= req.num_kv_tokens
            self.decode_waiting.appendleft(req)
        return self.num_kv_tokens + need <= self.kv_capacity_tokens

    # ------------------------------------------------------------ bookkeeping
    def release_prompt_kv(self, req: SimRequest) -> None:
        """The prompt's KV left for the token machine."""
        self.num_kv_tokens -= req.trace.num_prompt_tokens

    def finish_decode(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.num_kv_tokens -= req.num_kv_tokens
