# SPDX-License-Identifier: Apache-2.0
"""Scheduler half of `DisaggConnector` (runs in EngineCore): pure bookkeeping, no network.

More: README.md, "scheduler.py".
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.logger import init_logger

from vllm_disagg.kv.metadata import (
    CancelSpec,
    DisaggConnectorMetadata,
    DisaggWorkerMetadata,
    RecvSpec,
    SaveSpec,
)
from vllm_disagg.kv.spans import SchedulerSpans
from vllm_disagg.liveness import StepBeacon
from vllm_disagg.observe.context import TraceContext

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_disagg.kv.lamina.reuse import DisaggReuseScheduler

__all__ = ["DisaggConnectorScheduler", "RemotePrefillParams"]

logger = init_logger(__name__)


@dataclass(frozen=True)
class RemotePrefillParams:
    """The decode-side keys of `kv_transfer_params` (see docs/design/pd_protocol.md), validated."""

    transfer_id: str
    remote: str
    push_timeout_s: float

    @classmethod
    def parse(cls, params: dict[str, Any], default_timeout_s: float) -> RemotePrefillParams:
        transfer_id, host, port = params.get("transfer_id"), params.get("remote_host"), params.get("remote_port")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError(f"kv_transfer_params.transfer_id must be a non-empty string, got {transfer_id!r}")
        if not isinstance(host, str) or not host:
            raise ValueError(f"kv_transfer_params.remote_host must be a host name, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"kv_transfer_params.remote_port must be a port number, got {port!r}")
        timeout = params.get("push_timeout_s") or default_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"kv_transfer_params.push_timeout_s must be a positive number, got {timeout!r}")
        return cls(transfer_id, f"{host}:{port}", float(timeout))


def request_trace(request: Request) -> TraceContext | None:
    """The request's W3C trace context: `kv_transfer_params.traceparent` (set by the router), else
    the `traceparent` HTTP header vLLM kept on the request."""
    params = request.kv_transfer_params or {}
    if isinstance(params.get("traceparent"), str):
        return TraceContext.from_traceparent(params["traceparent"])
    return TraceContext.from_headers(getattr(request, "trace_headers", None))


def prompt_digest(request: Request) -> str:
    """Identifies the prompt on both sides, so a mixed-up transfer id can never ship foreign KV."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return ""
    return hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def num_leading_null_blocks(group: Any) -> int:
    """Blocks a sliding-window group left out (vLLM gives a windowed request its pool's null block
    for every block wholly before the window): D registers from the first real one, so P pushes
    nothing the window hides, and nothing lands in the null block all requests share."""
    return next((i for i, block in enumerate(group) if not getattr(block, "is_null", False)), len(group))


def recv_groups(request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
                block_size: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(start_block, block_ids) per KV cache group of the prompt blocks D registers: from the first
    block not cached here (nor left out by the group's window) to the prompt's end. Under vLLM's
    hybrid allocator a sliding-window group registers only the blocks its window still needs."""
    local_start = (request.num_prompt_tokens - num_external_tokens) // block_size
    end = math.ceil(request.num_prompt_tokens / block_size)
    out = []
    for group, ids in zip(blocks.blocks, blocks.get_block_ids(), strict=True):
        start = max(local_start, num_leading_null_blocks(group))
        out.append((start, tuple(ids[start:end])))
    return tuple(out)


class DisaggConnectorScheduler:
    def __init__(self, block_size: int, push_timeout_s: float, reuse: DisaggReuseScheduler | None = None,
                 kv_cache_manager: Callable[[], KVCacheManager | None] | None = None):
        self.block_size = block_size
        self.push_timeout_s = push_timeout_s
        self.reuse = reuse
        self._kv_cache_manager = kv_cache_manager or (lambda: None)
        self._attention_recoveries = 0
        # decode side
        self._recv_seen: set[str] = set()  # requests that got one load attempt (never retried)
        self._recv_inflight: dict[str, RecvSpec] = {}
        self._pending_recv: list[RecvSpec] = []
        self._pending_cancel: list[CancelSpec] = []
        self._recv_errors: dict[str, str] = {}  # req_id -> why its push failed
        self._fatal: set[str] = set()
        self._restored_pd: set[str] = set()  # P/D requests restored from the attention servers, not pushed
        # prefill side
        self._send_reqs: dict[str, tuple[str, int, str]] = {}  # req_id -> (transfer_id, #prompt, digest)
        self._send_trace: dict[str, TraceContext] = {}  # req_id -> its prefill.compute span (traced requests)
        self.spans = SchedulerSpans()
        self._send_announced: set[str] = set()
        self._pending_release: list[str] = []
        self._pending_abandon: list[str] = []  # aborted prefill requests: their pushes end now
        self._awaiting_send: set[str] = set()
        self._beacon = StepBeacon()
        """Tells this instance's API server that a step started (its `/live`, vllm_disagg/liveness/)."""
        self._beacon.start_heartbeat()

    # ---------------------------------------------------------------- decode side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.reuse is not None and not (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return self.reuse.get_num_new_matched_tokens(request, num_computed_tokens), False
        self._restored_pd.discard(request.request_id)
        if request.request_id in self._recv_seen or self._remote_prefill(request) is None:
            return 0, False
        if self.reuse is not None:  # a replayed P/D request whose KV the attention servers kept
            restored = self.reuse.takes_over_push(request, num_computed_tokens)
            if restored:
                self._restored_pd.add(request.request_id)
                return restored, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _remote_prefill(self, request: Request) -> RemotePrefillParams | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return RemotePrefillParams.parse(params, self.push_timeout_s)
        except ValueError as err:
            logger.warning("request %s: %s; computing the prompt locally", request.request_id, err)
            return None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        restored_pd = request.request_id in self._restored_pd
        if self.reuse is not None:
            pushed = params.get("do_remote_prefill") and not restored_pd  # external tokens come from the push
            self.reuse.update_state_after_alloc(request, blocks, 0 if pushed else num_external_tokens)
        if restored_pd:  # seen: after a preemption it is computed here, never pushed into blocks it may reuse
            if request.request_id not in self._recv_seen and (remote := self._remote_prefill(request)):
                self._pending_cancel.append(CancelSpec(request.request_id, remote.transfer_id, remote.remote,
                                                       "decode restored the prompt from its attention servers"))
            self._recv_seen.add(request.request_id)
            self.spans.plain_scheduled(request, restored=True)
            return
        if params.get("do_remote_decode") and request.request_id not in self._send_reqs:
            self._send_reqs[request.request_id] = (
                str(params.get("transfer_id", "")), request.num_prompt_tokens, prompt_digest(request)
            )
            if ctx := self.spans.prefill_scheduled(request):
                self._send_trace[request.request_id] = ctx
            return
        remote = self._remote_prefill(request)
        if remote is None and not params.get("do_remote_decode"):
            self.spans.plain_scheduled(request)
        if remote is None or num_external_tokens <= 0 or request.request_id in self._recv_seen:
            return
        self._recv_seen.add(request.request_id)
        (start_block, block_ids), *more_groups = recv_groups(request, blocks, num_external_tokens, self.block_size)
        spec = RecvSpec(
            req_id=request.request_id,
            transfer_id=remote.transfer_id,
            remote=remote.remote,
            block_ids=block_ids,
            start_block=start_block,
            num_prompt_tokens=request.num_prompt_tokens,
            push_timeout_s=remote.push_timeout_s,
            prompt_digest=prompt_digest(request),
            trace=self.spans.decode_allocated(request, remote.transfer_id) or request_trace(request),
            more_groups=tuple(more_groups),
        )
        self._recv_inflight[request.request_id] = spec
        self._pending_recv.append(spec)

    # ---------------------------------------------------------------- both sides
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DisaggConnectorMetadata:
        self._beacon.beat(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0))
        self.spans.step()
        meta = DisaggConnectorMetadata(
            recv_specs=self._pending_recv,
            save_specs=self._save_specs(scheduler_output),
            release_req_ids=self._pending_release,
            preempted_req_ids=sorted(set(scheduler_output.preempted_req_ids or ()) & self._send_announced),
            cancel_specs=self._pending_cancel,
            abandoned_req_ids=self._pending_abandon,
            reuse=self.reuse.build_meta(scheduler_output) if self.reuse is not None else None,
            step_trace=self.spans.step_trace(scheduler_output.num_scheduled_tokens) if self.reuse is not None else None,
        )
        self._pending_recv, self._pending_release, self._pending_cancel, self._pending_abandon = [], [], [], []
        return meta

    def _save_specs(self, out: SchedulerOutput) -> list[SaveSpec]:
        specs = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self._send_reqs:
                specs.append(self._save_spec(new.req_id, new.block_ids, new.num_computed_tokens, out, True))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._send_reqs:
                resumed = req_id in cached.resumed_req_ids
                new_ids = cached.new_block_ids[i] or ((),)
                specs.append(self._save_spec(req_id, new_ids, cached.num_computed_tokens[i], out, resumed))
        return [s for s in specs if s is not None]

    def _save_spec(
        self, req_id: str, block_ids: tuple, num_computed: int, out: SchedulerOutput, first: bool
    ) -> SaveSpec | None:
        transfer_id, num_prompt, digest = self._send_reqs[req_id]
        if num_computed >= num_prompt:
            return None  # decode steps of a prefill request carry nothing new to push
        announce = req_id not in self._send_announced
        self._send_announced.add(req_id)
        done = min(num_prompt, num_computed + out.num_scheduled_tokens.get(req_id, 0))
        return SaveSpec(
            req_id=req_id,
            new_block_ids=tuple(block_ids[0]),
            more_new_block_ids=tuple(tuple(ids) for ids in block_ids[1:]),
            num_computed_tokens=done,
            num_prompt_tokens=num_prompt,
            transfer_id=transfer_id if announce else None,
            replace_blocks=first,
            prompt_digest=digest if announce else "",
            trace=self._send_trace.pop(req_id, None) if announce else None,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.spans.finished(request)
        self._send_trace.pop(req_id, None)
        if self.reuse is not None:
            self.reuse.request_finished(request, block_ids)
        self._recv_seen.discard(req_id)
        waiting = self._recv_inflight.pop(req_id, None)
        if waiting is not None:  # finished before its KV landed: aborted; vLLM frees on finished_recving
            self._pending_cancel.append(CancelSpec(req_id, waiting.transfer_id, waiting.remote,
                                                   "request aborted on the decode instance"))
        self._restored_pd.discard(req_id)
        self._fatal.discard(req_id)
        error = self._recv_errors.pop(req_id, None)
        if error is not None:
            return False, {"disagg_kv_error": error}  # the router can tell a local-prefill fallback
        if req_id not in self._send_reqs:
            return False, None
        transfer_id, _, _ = self._send_reqs.pop(req_id)
        if req_id not in self._send_announced:
            return False, {"transfer_id": transfer_id, "pushed": False}
        self._send_announced.discard(req_id)
        self._pending_release.append(req_id)
        self._awaiting_send.add(req_id)
        if getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED":  # the router dropped it
            self._pending_abandon.append(req_id)  # (D failed or the client left): no decode side wants it
        return True, {"transfer_id": transfer_id, "pushed": True}

    def is_fatal_load_failure(self, req_id: str) -> bool:
        return req_id in self._fatal

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, DisaggWorkerMetadata):
            self._recv_errors.update(meta.errors)
            self._fatal |= meta.fatal
            if meta.attention_recoveries > self._attention_recoveries:
                self._attention_recoveries = meta.attention_recoveries
                self._forget_cached_blocks()
        for req_id in connector_output.finished_sending or ():
            self._awaiting_send.discard(req_id)
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self.spans.kv_landed(req_id, self._recv_errors.get(req_id, "the push failed"))
        for req_id in connector_output.finished_recving or ():
            self._recv_inflight.pop(req_id, None)
            self.spans.kv_landed(req_id)

    def _forget_cached_blocks(self) -> None:
        """An attention server was lost: part of every cached block's KV lived there. The recovery
        rebuilt the running requests' KV; a later request that hit an older cached chain would read
        what the replacement server holds instead (found by benchmarks/chaos.py: wrong tokens after
        an attention server restart). So every block leaves vLLM's prefix cache; running requests keep
        their blocks, only the sharing of them ends."""
        manager = self._kv_cache_manager()
        if manager is None:
            return
        manager.evict_blocks(set(range(len(manager.block_pool.blocks))))
        logger.warning("remote attention recovered from a lost server: the prefix cache was emptied "
                       "(its blocks' KV was partly on that server)")

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_send or self._pending_release or self._pending_recv or self._pending_cancel)
