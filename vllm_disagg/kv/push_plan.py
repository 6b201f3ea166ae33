# SPDX-License-Identifier: Apache-2.0
"""The prefill side's push bookkeeping without threads or I/O: what each push may write next, when
it is over, and why it failed. `PushSender` (push_sender.py) holds the lock, runs the side channel
and the sender thread, and calls these methods; every method here assumes that lock is held.

Lifecycle and targets of a push: see push_sender.py.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.config import KVTransferSection
from vllm_disagg.kv.layer_events import LayerEvent
from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec
from vllm_disagg.observe.context import TraceContext
from vllm_disagg.transport import BlockWrite, XferState
from vllm_disagg.transport.checksum import encode_shards, layer_checksums

logger = init_logger(__name__)
_CANCELLED_TTL_S = 600.0
_MAX_CANCELLED = 4096
ALL_LAYERS = -1
NULL_BLOCK_ID = 0
"""vLLM's BlockPool keeps block 0 as the null block a sliding-window group gets for blocks outside its
window: never a source of the push (its bytes belong to no request)."""

WorkItem = tuple["Push", list[BlockWrite], int]
"""(push, writes, layer): one write_blocks call; layer -1 for a serialized push's single write."""


@dataclass
class Registration:
    address: str
    """Decode side's name for logs (its receiver, or its first attention server)."""
    block_ids: tuple[int, ...]
    start_block: int
    """`block_ids` and `start_block` are KV cache group 0's; `more_groups` the others' (RecvSpec's)."""
    timeout_s: float
    num_prompt_tokens: int
    prompt_digest: str
    t_arrival: float = field(default_factory=time.monotonic)
    targets: tuple[tuple[str, int, int], ...] = ()
    """(receiver address, num_shards, shard): where each layer's blocks (or their head slice) go."""
    trace: TraceContext | None = None
    """The decode request's W3C trace context (REGISTER), for the tracer."""
    verify: bool = False
    """D asked for the pushed blocks' checksums (`kv.verify_checksums`): kept for its VERIFY."""
    more_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def groups(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return ((self.start_block, self.block_ids), *self.more_groups)


@dataclass
class Push:
    req_id: str
    transfer_id: str
    num_prompt_tokens: int
    layerwise: bool
    block_ids: list[list[int]]
    """This side's block table of the prompt, one per KV cache group."""
    ready_tokens: list[int]
    sent_blocks: list[int]
    deadline: float
    prompt_digest: str = ""
    reg: Registration | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)
    """Per layer, [first, end) of the prompt blocks `reg` registered for that layer's KV cache group
    (set with `reg`: read on every sender tick)."""
    handles: list = field(default_factory=list)  # (XferHandle, layer, t_issue, nbytes)
    error: str | None = None
    done: bool = False
    released: bool = False
    t_first_issue: float | None = None
    t_prefill_done: float | None = None
    t_created: float = field(default_factory=time.monotonic)
    t_done: float | None = None
    """When the push completed or failed."""
    trace: TraceContext | None = None
    """P's prefill.compute (`SaveSpec.trace`); the push span's parent unless D's registration names one."""

    @property
    def pending(self) -> bool:
        return any(h.state() is XferState.PENDING for h, *_ in self.handles)

    @property
    def over(self) -> bool:
        return (self.done or self.error is not None) and not self.pending


class PushPlan:
    """Every push of one prefill worker, keyed by req_id (the decode side knows it by transfer_id)."""

    def __init__(self, layers: list[Any], block_size: int, cfg: KVTransferSection,
                 layer_groups: tuple[int, ...] = ()):
        self.layers, self.block_size, self.cfg = layers, block_size, cfg
        self.layer_groups = layer_groups or (0,) * len(layers)
        """The KV cache group of each layer: its blocks are addressed by that group's block table."""
        self.num_groups = max(self.layer_groups, default=0) + 1
        self.pushes: dict[str, Push] = {}
        self.by_tid: dict[str, str] = {}
        self.registry: dict[str, Registration] = {}
        self.rejected: dict[str, str] = {}
        self.cancelled: dict[str, tuple[str, float]] = {}
        """transfer id -> (why, when): CANCELs that came before their prefill request (D took the push
        over or its request was aborted), so that push fails the moment it is created."""
        self.step_reqs: list[SaveSpec] = []
        self.unready: deque[tuple[LayerEvent, int, list[tuple[str, int]]]] = deque()
        """Saved layers whose event has not completed: (event, layer or ALL_LAYERS, [(req_id, tokens)]),
        in record order (an event completes only after the ones recorded before it)."""
        self.orphans: set[str] = set()
        self.failed: dict[str, tuple[str, float]] = {}
        """transfer id -> (why, when): failed pushes already freed, for D's STATUS (`status`)."""
        self.completed: dict[str, tuple[tuple[float, float], float]] = {}
        """transfer id -> ((prefill seconds, when the prefill ended), when completed): pushes whose every write left here,
        for D's STATUS while their bytes may still be on a slow link (`prefill_timing`)."""
        self.checksums: dict[str, tuple[str, float]] = {}
        """transfer id -> (per-layer CRC32s, when): completed pushes whose decode side asked to verify
        them, until its VERIFY takes them (or _CANCELLED_TTL_S passes)."""
        self.timeline: deque[dict[str, Any]] = deque(maxlen=1024)
        """Recent completed pushes with monotonic timestamps (first write issued, prefill done,
        last write landed): the evidence that layer-wise pushes overlap prefill."""

    # ------------------------------------------------------------ engine thread
    def bind(self, meta: DisaggConnectorMetadata) -> None:
        self.step_reqs = meta.save_specs
        for spec in meta.save_specs:
            self._apply_spec(spec)
        for req_id in meta.preempted_req_ids:
            self.fail(self.pushes.get(req_id), "request preempted on the prefill instance")
        for req_id in meta.abandoned_req_ids:
            self.fail(self.pushes.get(req_id), "request aborted on the prefill instance")
        for req_id in meta.release_req_ids:
            push = self.pushes.get(req_id)
            if push is not None:
                push.released = True
            else:  # never saw it: nothing of ours reads its blocks, free them now
                self.orphans.add(req_id)

    def _apply_spec(self, spec: SaveSpec) -> None:
        push = self.pushes.get(spec.req_id)
        if push is None:
            transfer_id = spec.transfer_id or ""
            layerwise = spec.num_prompt_tokens >= self.cfg.layerwise_threshold_tokens
            push = Push(spec.req_id, transfer_id, spec.num_prompt_tokens, layerwise,
                        [[] for _ in range(self.num_groups)], [0] * len(self.layers),
                        [0] * len(self.layers), time.monotonic() + self.cfg.push_timeout_s, spec.prompt_digest,
                        trace=spec.trace)
            self.pushes[spec.req_id] = push
            self.by_tid[transfer_id] = spec.req_id
            if not transfer_id:
                self.fail(push, "request has no kv_transfer_params.transfer_id")
            elif transfer_id in self.rejected:
                self.fail(push, self.rejected.pop(transfer_id))
            elif transfer_id in self.cancelled:
                self.fail(push, f"cancelled by the decode instance ({self.cancelled.pop(transfer_id)[0]})")
        for group, ids in zip(push.block_ids, spec.groups()):  # a step without new blocks lists group 0 alone
            if spec.replace_blocks:
                group[:] = ids
            else:
                group.extend(ids)

    def layer_saved(self, layer_idx: int, event: LayerEvent) -> None:
        """Layer `layer_idx` (ALL_LAYERS: every layer) of this step's requests is written once `event`
        completes: ready at once on CPU (`DONE`), else when `promote_ready` sees the event done."""
        updates = [(spec.req_id, spec.num_computed_tokens) for spec in self.step_reqs]
        if not self.unready and event.query():
            self._mark_ready(layer_idx, updates)
        else:
            self.unready.append((event, layer_idx, updates))

    def promote_ready(self) -> None:
        """Mark the saved layers whose events have completed (sender thread)."""
        while self.unready and self.unready[0][0].query():
            _, layer_idx, updates = self.unready.popleft()
            self._mark_ready(layer_idx, updates)

    def oldest_unready(self) -> LayerEvent | None:
        return self.unready[0][0] if self.unready else None

    def _mark_ready(self, layer_idx: int, updates: list[tuple[str, int]]) -> None:
        layers = range(len(self.layers)) if layer_idx == ALL_LAYERS else (layer_idx,)
        for req_id, tokens in updates:
            push = self.pushes.get(req_id)
            if push is None:
                continue
            for layer in layers:
                push.ready_tokens[layer] = max(push.ready_tokens[layer], tokens)
            if layers[-1] == len(self.layers) - 1 and tokens >= push.num_prompt_tokens:
                push.t_prefill_done = push.t_prefill_done or time.monotonic()

    def finished(self) -> set[str]:
        over = {r for r, p in self.pushes.items() if p.released and p.over}
        for req_id in over:
            push = self.pushes.pop(req_id)
            self.by_tid.pop(push.transfer_id, None)
            if push.error is not None and push.transfer_id:
                _keep(self.failed, push.transfer_id, push.error)
        over |= self.orphans
        self.orphans = set()
        return over

    # ------------------------------------------------------------ side channel thread
    def register(self, transfer_id: str, reg: Registration) -> None:
        self.registry[transfer_id] = reg

    def reject(self, transfer_id: str, why: str) -> None:
        self.rejected[transfer_id] = why
        self.fail(self.pushes.get(self.by_tid.get(transfer_id, "")), why)

    def cancel(self, transfer_id: str, reason: str) -> Push | None:
        """Stop push `transfer_id` (its blocks are freed once the request is released); a CANCEL ahead of the
        prefill request is remembered so that push fails the moment it is created."""
        push = self.pushes.get(self.by_tid.get(transfer_id, "")) if transfer_id else None
        self.registry.pop(transfer_id, None)
        if push is None and transfer_id:
            _keep(self.cancelled, transfer_id, reason[:200])
        self.fail(push, f"cancelled by the decode instance ({reason[:200]})")
        return push

    def status(self, transfer_id: str) -> tuple[str, str]:
        """(state, why) for D's STATUS: `waiting` (registered, prefill not begun here), `pushing`,
        `done`, `failed` (why), or `unknown`: no record, as after a restart, so no byte will come."""
        push = self.pushes.get(self.by_tid.get(transfer_id, ""))
        if push is not None:
            return ("failed", push.error) if push.error else ("done" if push.done else "pushing", "")
        for gone in (self.failed, self.cancelled):
            if transfer_id in gone:
                return "failed", gone[transfer_id][0]
        if transfer_id in self.rejected:
            return "failed", self.rejected[transfer_id]
        if transfer_id in self.completed:
            return "done", ""
        return ("waiting", "") if transfer_id in self.registry else ("unknown", "")

    def prefill_timing(self, transfer_id: str) -> dict[str, float]:
        """For D's STATUS of a push still landing after its prefill finished here: `prefill_s`, what
        computing the prompt took (about what D's recompute would cost), and `since_prefill_s`, how long
        its bytes have been on the link alone since (kv/push_status.py weighs one against the other)."""
        push = self.pushes.get(self.by_tid.get(transfer_id, ""))
        if push is not None and push.t_prefill_done is not None and push.error is None:
            prefill_s, t_prefill_done = push.t_prefill_done - push.t_created, push.t_prefill_done
        elif push is None and transfer_id in self.completed:
            prefill_s, t_prefill_done = self.completed[transfer_id][0]
        else:
            return {}
        return {"prefill_s": round(prefill_s, 4), "since_prefill_s": round(time.monotonic() - t_prefill_done, 4)}

    # ------------------------------------------------------------ sender thread
    def busy(self) -> bool:
        return any(p.pending for p in self.pushes.values())

    def plan(self) -> list[WorkItem]:
        """The writes whose blocks are ready and registered, marked as sent."""
        now, work = time.monotonic(), []
        for push in self.pushes.values():
            if push.error or push.done:
                continue
            if push.reg is None:
                push.reg = self.registry.pop(push.transfer_id, None)
                if push.reg is None:
                    if now > push.deadline:
                        self.fail(push, f"no decode registration within {self.cfg.push_timeout_s}s")
                    continue
                push.deadline = now + max(push.reg.timeout_s, self.cfg.push_timeout_s)
                push.ranges = self._layer_ranges(push)
                if not self._same_prompt(push):
                    continue
            work.extend(self._plan_push(push))
        self._gc_registry(now)
        return work

    def _plan_push(self, push: Push) -> list[WorkItem]:
        num_blocks = math.ceil(push.num_prompt_tokens / self.block_size)
        spans, waiting = [], False
        for layer, ready in enumerate(push.ready_tokens):
            first, end = push.ranges[layer]
            src_ids = push.block_ids[self.layer_groups[layer]]
            ready_blocks = num_blocks if ready >= push.num_prompt_tokens else ready // self.block_size
            lo = max(push.sent_blocks[layer], first)
            hi = min(ready_blocks, end, len(src_ids))
            if NULL_BLOCK_ID in src_ids[lo:hi]:
                self.fail(push, f"decode registered a block of layer {layer} that this side's window left out "
                                "(vLLM's null block): the two sides' windows differ")
                return []
            spans.append((layer, lo, hi))
            waiting |= hi < end
        if not push.layerwise:
            if waiting:
                return []
            spans = [(layer, lo, hi) for layer, lo, hi in spans if hi > lo]
            return [(push, [self._write(push, *s) for s in spans], -1)] if spans else []
        return [(push, [self._write(push, *s)], s[0]) for s in spans if s[2] > s[1]]

    def _layer_ranges(self, push: Push) -> list[tuple[int, int]]:
        """`Push.ranges`: per layer, [first, end) of the prompt blocks D registered for its KV cache group."""
        num_blocks = math.ceil(push.num_prompt_tokens / self.block_size)
        groups = [(first, min(num_blocks, first + len(ids))) for first, ids in push.reg.groups()]
        return [groups[g] for g in self.layer_groups]

    def _same_prompt(self, push: Push) -> bool:
        reg = push.reg
        if reg.num_prompt_tokens != push.num_prompt_tokens:
            self.fail(push, f"decode registered a {reg.num_prompt_tokens}-token prompt, "
                            f"prefill has {push.num_prompt_tokens} tokens (same transfer_id, different prompts?)")
        elif reg.prompt_digest and push.prompt_digest and reg.prompt_digest != push.prompt_digest:
            self.fail(push, "decode and prefill prompts differ (prompt_digest); check that the router sends "
                            "the same prompt (and chat template) to both")
        return push.error is None

    def _write(self, push: Push, layer: int, lo: int, hi: int) -> BlockWrite:
        group = self.layer_groups[layer]
        first, dst_ids = push.reg.groups()[group]
        push.sent_blocks[layer] = hi
        return BlockWrite(str(layer), self.layers[layer], push.block_ids[group][lo:hi], dst_ids[lo - first : hi - first])

    def issued(self, push: Push, handle: Any, layer: int, num_bytes: int) -> None:
        push.t_first_issue = push.t_first_issue or time.monotonic()
        push.handles.append((handle, layer, time.monotonic(), num_bytes))

    def reap(self) -> tuple[list[Push], set[str], list[Push]]:
        """(pushes completed now, target addresses of failed writes: their connections are suspect,
        verified pushes whose last byte is out, to checksum outside the lock and then
        `complete_verified`; before completing, for then their blocks may be freed and reused)."""
        now, completed, suspect, to_checksum = time.monotonic(), [], set(), []
        for push in self.pushes.values():
            for handle, layer, *_ in push.handles:
                if handle.state() is XferState.FAILED and push.error is None:
                    suspect.update(address for address, *_ in push.reg.targets)
                    self.fail(push, f"write of layer {layer} failed: {handle.error}")
            if push.error or push.done or push.reg is None or push.pending:
                if push.pending and now > push.deadline and push.error is None:
                    self.fail(push, "push still in flight at its deadline")
                continue
            if all(max(sent, first) >= end for sent, (first, end) in zip(push.sent_blocks, push.ranges)):
                if push.reg.verify:
                    to_checksum.append(push)
                else:
                    self._complete(push, now)
                    completed.append(push)
        return completed, suspect, to_checksum

    def block_checksums(self, push: Push) -> str:
        """The checksums D's VERIFY asks for: every layer's CRC over the pushed blocks, per KV-head shard
        when the push is split over head-wise attention servers. Reads the blocks only (the caller holds
        no lock: a push cancelled meanwhile is dropped by `complete_verified`)."""
        per_layer = [push.block_ids[g][first:end] for g, (first, end) in zip(self.layer_groups, push.ranges)]
        num_shards = max((n for _, n, _ in push.reg.targets), default=1)  # one list when unsharded
        return encode_shards([layer_checksums(self.layers, per_layer, num_shards, shard) for shard in range(num_shards)])

    def complete_verified(self, push: Push, checksums: str) -> bool:
        """Keep a verified push's checksums and complete it, unless it failed or was cancelled meanwhile."""
        if push.error is not None or push.done:
            return False
        now = time.monotonic()
        _keep(self.checksums, push.transfer_id, checksums)
        self._complete(push, now)
        return True

    def _complete(self, push: Push, now: float) -> None:
        push.done = True
        push.t_done = now
        if push.transfer_id and push.t_prefill_done is not None:
            _keep(self.completed, push.transfer_id, (push.t_prefill_done - push.t_created, push.t_prefill_done))
        t0 = push.t_first_issue or now
        self.timeline.append({
            "transfer_id": push.transfer_id, "layerwise": push.layerwise, "num_writes": len(push.handles),
            "num_bytes": sum(nbytes for *_, nbytes in push.handles),
            "t_prefill_start": push.t_created, "t_first_issue": t0, "t_prefill_done": push.t_prefill_done,
            "t_done": now,
        })
        logger.debug("KV push %s done: %d writes, %.1f ms, exposed %.1f ms", push.transfer_id,
                     len(push.handles), 1e3 * (now - t0), 1e3 * (now - (push.t_prefill_done or now)))

    def fail(self, push: Push | None, reason: str) -> None:
        if push is not None and push.error is None and not push.done:
            push.error = reason
            push.t_done = time.monotonic()
            logger.warning("KV push %s (request %s) abandoned: %s", push.transfer_id, push.req_id, reason)

    def _gc_registry(self, now: float) -> None:
        for transfer_id, reg in list(self.registry.items()):
            if now - reg.t_arrival > max(reg.timeout_s, self.cfg.push_timeout_s):
                del self.registry[transfer_id]
                logger.warning("KV push %s: registration expired, no prefill request with that id", transfer_id)
        if len(self.rejected) > 4096:
            self.rejected.clear()
        for kept in (self.cancelled, self.checksums, self.failed, self.completed):
            for transfer_id, (_, t) in list(kept.items()):
                if now - t <= _CANCELLED_TTL_S:
                    break  # insertion order is arrival order
                del kept[transfer_id]


def _keep(kept: dict[str, tuple[Any, float]], transfer_id: str, value: Any) -> None:
    """Remember `value` for `transfer_id` until _CANCELLED_TTL_S passes (`_gc_registry`), at most
    _MAX_CANCELLED of them (oldest dropped first)."""
    kept[transfer_id] = (value, time.monotonic())
    while len(kept) > _MAX_CANCELLED:
        del kept[next(iter(kept))]


def shard_writes(writes: list[BlockWrite], num_shards: int, shard: int) -> list[BlockWrite]:
    """KV-head slice `shard` of every block: block b of `[NB, H, ...]` viewed as NB*num_shards contiguous
    sub-blocks, of which b*num_shards + shard is this shard's heads (zero-copy)."""
    if num_shards == 1:
        return writes
    out = []
    for w in writes:
        src = w.src.view(w.src.shape[0] * num_shards, -1)
        out.append(BlockWrite(w.region, src, [b * num_shards + shard for b in w.src_block_ids], w.dst_block_ids))
    return out
