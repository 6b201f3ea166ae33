# SPDX-License-Identifier: Apache-2.0
"""Prefill side of the KV push (runs in the prefill worker): side channel + sender thread.

Lifecycle of one push (`_Push`, keyed by req_id; the decode side knows it by transfer_id):

    created    first SaveSpec seen (step that schedules the request)
    ready      after each layer's attention, `layer_saved(L)` marks the tokens whose KV is written;
               `step_done()` marks all layers (the forward is over)
    registered the decode worker's REGISTER arrived on the side channel and passed the handshake
    issuing    sender thread: layer-wise -> one write per layer as soon as whole blocks are ready;
               serialized (prompt < layerwise_threshold_tokens) -> one write of all layers at the end
    over       every block of every layer landed (done) or the push failed (handshake, timeout,
               peer lost, cancelled, preempted) and no write is still in flight
    released   scheduler finished the request (delay_free); once over -> finished_sending

Blocks are read by the sender thread while the engine keeps running: safe because the scheduler
keeps them allocated until finished_sending, and CPU_ATTN has written a layer's KV when
save_kv_layer runs. (On GPU a stream event must be recorded per layer before queueing; not done.)

Targets: by default the decode worker's own receiver (`address`). A decode model worker with remote
attention registers `targets` instead, "address,num_shards,shard" per attention server, ";"-joined
(`vllm_disagg.kv.lamina.targets`): each gets KV-head slice `shard` of `num_shards` of every block (a
contiguous part of the block in the CPU layout), or whole blocks with `num_shards=1`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.config import KVTransferSection
from vllm_disagg.errors import DisaggError, HandshakeMismatch
from vllm_disagg.kv.handshake import (
    HandshakeInfo,
    MsgType,
    SideMsg,
    VersionMismatch,
    check_compatible,
    decode_msg,
    encode_msg,
    handshake_body,
    legacy_reject,
)
from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec
from vllm_disagg.kv.side_channel import SideChannelServer
from vllm_disagg.kv.stats import StatsSink
from vllm_disagg.observe.context import TraceContext
from vllm_disagg.transport import BlockWrite, KVPeer, Transport, XferState

__all__ = ["PushSender"]

logger = init_logger(__name__)
_CANCELLED_TTL_S = 600.0
_MAX_CANCELLED = 4096


@dataclass
class _Registration:
    address: str
    """Decode side's name for logs (its receiver, or its first attention server)."""
    block_ids: tuple[int, ...]
    start_block: int
    timeout_s: float
    num_prompt_tokens: int
    prompt_digest: str
    t_arrival: float = field(default_factory=time.monotonic)
    targets: tuple[tuple[str, int, int], ...] = ()
    """(receiver address, num_shards, shard): where each layer's blocks (or their head slice) go."""
    trace: TraceContext | None = None
    """The decode request's W3C trace context (REGISTER), for the tracer."""


@dataclass
class _Push:
    req_id: str
    transfer_id: str
    num_prompt_tokens: int
    layerwise: bool
    block_ids: list[int]
    ready_tokens: list[int]
    sent_blocks: list[int]
    deadline: float
    prompt_digest: str = ""
    reg: _Registration | None = None
    handles: list = field(default_factory=list)  # (XferHandle, layer, t_issue, nbytes)
    error: str | None = None
    done: bool = False
    released: bool = False
    t_first_issue: float | None = None
    t_prefill_done: float | None = None
    t_created: float = field(default_factory=time.monotonic)

    @property
    def pending(self) -> bool:
        return any(h.state() is XferState.PENDING for h, *_ in self.handles)

    @property
    def over(self) -> bool:
        return (self.done or self.error is not None) and not self.pending


class PushSender:
    """Owns the prefill worker's side channel (on `control`), KV sender (on `data`) and sender thread."""

    def __init__(self, control: Transport, data: Transport, handshake: HandshakeInfo, token: str, layers: list[Any],
                 cfg: KVTransferSection, stats: StatsSink):
        self.handshake, self.token, self.layers, self.cfg = handshake, token, layers, cfg
        self.block_size = handshake.block_size
        self._stats, self._stats_lock = stats
        self._cond = threading.Condition()
        self._pushes: dict[str, _Push] = {}
        self._by_tid: dict[str, str] = {}
        self._registry: dict[str, _Registration] = {}
        self._rejected: dict[str, str] = {}
        self._cancelled: dict[str, tuple[str, float]] = {}
        """transfer id -> (why, when): CANCELs that came before their prefill request (D took the push
        over or its request was aborted), so that push fails the moment it is created."""
        self._step_reqs: list[SaveSpec] = []
        self._orphans: set[str] = set()
        self._stop = threading.Event()
        self.server = SideChannelServer(control.listen_msg(), self._on_message)
        self.address = self.server.address
        self._sender = data.kv_sender(name=self.address)
        self._peers: dict[str, KVPeer] = {}
        self.timeline: deque[dict[str, Any]] = deque(maxlen=1024)
        """Recent completed pushes with monotonic timestamps (first write issued, prefill done,
        last write landed): the evidence that layer-wise pushes overlap prefill."""
        self._thread = threading.Thread(target=self._run, name="disagg-kv-sender", daemon=True)
        self._thread.start()
        logger.info("KV push side channel listening on %s", self.address)

    # ------------------------------------------------------------ engine thread
    def bind(self, meta: DisaggConnectorMetadata) -> None:
        with self._cond:
            self._step_reqs = meta.save_specs
            for spec in meta.save_specs:
                self._apply_spec(spec)
            for req_id in meta.preempted_req_ids:
                self._fail(self._pushes.get(req_id), "request preempted on the prefill instance")
            for req_id in meta.release_req_ids:
                push = self._pushes.get(req_id)
                if push is not None:
                    push.released = True
                else:  # never saw it: nothing of ours reads its blocks, free them now
                    self._orphans.add(req_id)
            self._cond.notify()
        self._wait_quiet(meta.preempted_req_ids)

    def _apply_spec(self, spec: SaveSpec) -> None:
        push = self._pushes.get(spec.req_id)
        if push is None:
            tid = spec.transfer_id or ""
            layerwise = spec.num_prompt_tokens >= self.cfg.layerwise_threshold_tokens
            push = _Push(spec.req_id, tid, spec.num_prompt_tokens, layerwise, [], [0] * len(self.layers),
                         [0] * len(self.layers), time.monotonic() + self.cfg.push_timeout_s, spec.prompt_digest)
            self._pushes[spec.req_id] = push
            self._by_tid[tid] = spec.req_id
            if not tid:
                self._fail(push, "request has no kv_transfer_params.transfer_id")
            elif tid in self._rejected:
                self._fail(push, self._rejected.pop(tid))
            elif tid in self._cancelled:
                self._fail(push, f"cancelled by the decode instance ({self._cancelled.pop(tid)[0]})")
        if spec.replace_blocks:
            push.block_ids = list(spec.new_block_ids)
        else:
            push.block_ids.extend(spec.new_block_ids)

    def layer_saved(self, layer_idx: int) -> None:
        with self._cond:
            for spec in self._step_reqs:
                push = self._pushes.get(spec.req_id)
                if push is not None:
                    push.ready_tokens[layer_idx] = max(push.ready_tokens[layer_idx], spec.num_computed_tokens)
                    if layer_idx == len(self.layers) - 1 and spec.num_computed_tokens >= push.num_prompt_tokens:
                        push.t_prefill_done = push.t_prefill_done or time.monotonic()
            self._cond.notify()

    def step_done(self) -> None:
        """The forward pass is over: every layer of this step's requests is written."""
        for layer_idx in range(len(self.layers)):
            self.layer_saved(layer_idx)
        with self._cond:
            self._step_reqs = []

    def finished_sending(self) -> set[str]:
        with self._cond:
            over = {r for r, p in self._pushes.items() if p.released and p.over}
            for req_id in over:
                self._by_tid.pop(self._pushes.pop(req_id).transfer_id, None)
            over |= self._orphans
            self._orphans = set()
        return over

    def has_pending(self) -> bool:
        with self._cond:
            return bool(self._pushes)

    def _wait_quiet(self, req_ids: list[str]) -> None:
        """Block (bounded) until no write of `req_ids` still reads blocks that are being reused."""
        for req_id in req_ids:
            push = self._pushes.get(req_id)
            for handle, *_ in list(push.handles) if push else ():
                try:
                    handle.wait(self.cfg.push_timeout_s)
                except DisaggError:
                    pass

    # ------------------------------------------------------------ side channel thread
    def _on_message(self, raw: bytes, peer: str) -> bytes | None:
        try:
            msg = decode_msg(raw, peer)
        except VersionMismatch as err:  # an older decode instance: refuse it in words it can read
            logger.error("KV side channel: %s", err)
            self._record(lambda s: s.record_handshake_failure())
            return legacy_reject(raw, err)
        if msg.type is MsgType.REGISTER:
            return encode_msg(self._on_register(msg, peer))
        if msg.type is MsgType.CANCEL:
            self._on_cancel(msg.transfer_id, str(msg.body.get("reason") or "push timeout"))
            return encode_msg(SideMsg(MsgType.CANCEL_ACK, {"transfer_id": msg.transfer_id}))
        logger.warning("KV side channel: unexpected %s from %s; ignored", msg.type.name, peer)
        return None

    def _on_register(self, msg: SideMsg, peer: str) -> SideMsg:
        tid = msg.transfer_id
        try:
            check_compatible(self.handshake, msg.body, self.token, tid, peer)
            reg = _Registration(str(msg.body["address"]), msg.block_ids, int(msg.body["start_block"]),
                                float(msg.body.get("push_timeout_s") or self.cfg.push_timeout_s),
                                int(msg.body["num_prompt_tokens"]), str(msg.body.get("prompt_digest") or ""),
                                targets=_targets(msg.body, self.handshake.num_kv_heads), trace=msg.trace)
        except HandshakeMismatch as err:
            why = (f"KV handshake mismatch on {err.field!r}: prefill {self.address} has {err.local!r}, "
                   f"decode {msg.body.get('address', peer)} has {err.remote!r}")
            logger.error("KV push %s refused: %s", tid, why)
            self._record(lambda s: s.record_handshake_failure())
            with self._cond:
                self._rejected[tid] = why
                self._fail(self._pushes.get(self._by_tid.get(tid, "")), why)
            return SideMsg(MsgType.REJECT, {"transfer_id": tid, "field": err.field, "message": why})
        except (KeyError, TypeError, ValueError) as err:
            return SideMsg(MsgType.REJECT, {"transfer_id": tid, "field": "register", "message": repr(err)})
        with self._cond:
            self._registry[tid] = reg
            self._cond.notify()
        logger.debug("KV push %s: decode registered %d blocks from %s", tid, len(reg.block_ids), peer)
        return SideMsg(MsgType.ACCEPT, handshake_body(self.handshake, self.token, tid))

    def _on_cancel(self, tid: str, reason: str) -> None:
        """Stop push `tid` (its blocks are freed once the request is released); a CANCEL ahead of the
        prefill request is remembered so that push fails the moment it is created."""
        with self._cond:
            push = self._pushes.get(self._by_tid.get(tid, "")) if tid else None
            self._registry.pop(tid, None)
            if push is None and tid:
                self._cancelled[tid] = (reason[:200], time.monotonic())
                while len(self._cancelled) > _MAX_CANCELLED:
                    del self._cancelled[next(iter(self._cancelled))]
            self._fail(push, f"cancelled by the decode instance ({reason[:200]})")
            self._cond.notify()
        if push is not None:
            self._wait_quiet([push.req_id])

    # ------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                busy = any(p.pending for p in self._pushes.values())
                self._cond.wait(0.002 if busy else 0.05)
                work = self._plan()
            for push, writes, layer in work:
                self._issue(push, writes, layer)
            with self._cond:
                self._reap()

    def _plan(self) -> list[tuple[_Push, list[BlockWrite], int]]:
        now, work = time.monotonic(), []
        for push in self._pushes.values():
            if push.error or push.done:
                continue
            if push.reg is None:
                push.reg = self._registry.pop(push.transfer_id, None)
                if push.reg is None:
                    if now > push.deadline:
                        self._fail(push, f"no decode registration within {self.cfg.push_timeout_s}s")
                    continue
                push.deadline = now + max(push.reg.timeout_s, self.cfg.push_timeout_s)
                if not self._same_prompt(push):
                    continue
            work.extend(self._plan_push(push))
        self._gc_registry(now)
        return work

    def _plan_push(self, push: _Push) -> list[tuple[_Push, list[BlockWrite], int]]:
        reg, num_blocks = push.reg, math.ceil(push.num_prompt_tokens / self.block_size)
        first, end = reg.start_block, min(num_blocks, reg.start_block + len(reg.block_ids))
        spans = []
        for layer, ready in enumerate(push.ready_tokens):
            ready_blocks = num_blocks if ready >= push.num_prompt_tokens else ready // self.block_size
            lo, hi = max(push.sent_blocks[layer], first), min(ready_blocks, end, len(push.block_ids))
            spans.append((layer, lo, hi))
        if not push.layerwise:
            if any(hi < end for _, _, hi in spans):
                return []
            spans = [(layer, lo, hi) for layer, lo, hi in spans if hi > lo]
            return [(push, [self._write(push, *s) for s in spans], -1)] if spans else []
        return [(push, [self._write(push, *s)], s[0]) for s in spans if s[2] > s[1]]

    def _same_prompt(self, push: _Push) -> bool:
        reg = push.reg
        if reg.num_prompt_tokens != push.num_prompt_tokens:
            self._fail(push, f"decode registered a {reg.num_prompt_tokens}-token prompt, "
                             f"prefill has {push.num_prompt_tokens} tokens (same transfer_id, different prompts?)")
        elif reg.prompt_digest and push.prompt_digest and reg.prompt_digest != push.prompt_digest:
            self._fail(push, "decode and prefill prompts differ (prompt_digest); check that the router sends "
                             "the same prompt (and chat template) to both")
        return push.error is None

    def _write(self, push: _Push, layer: int, lo: int, hi: int) -> BlockWrite:
        first = push.reg.start_block
        push.sent_blocks[layer] = hi
        return BlockWrite(str(layer), self.layers[layer], push.block_ids[lo:hi],
                          push.reg.block_ids[lo - first : hi - first])

    def _issue(self, push: _Push, writes: list[BlockWrite], layer: int) -> None:
        for address, num_shards, shard in push.reg.targets:
            if not self._issue_to(push, _shard_writes(writes, num_shards, shard), layer, address, num_shards):
                return

    def _issue_to(self, push: _Push, writes: list[BlockWrite], layer: int, address: str, num_shards: int) -> bool:
        nbytes = sum(len(w.src_block_ids) for w in writes) * self.handshake.block_nbytes // num_shards
        try:
            peer = self._peer(address)
            handle = peer.write_blocks(writes, push.transfer_id, layer)
        except (DisaggError, OSError, ValueError) as err:
            self._peers.pop(address, None)
            with self._cond:
                self._fail(push, f"write to {address} failed: {err}")
            return False
        with self._cond:
            push.t_first_issue = push.t_first_issue or time.monotonic()
            push.handles.append((handle, layer, time.monotonic(), nbytes))
        return True

    def _peer(self, address: str) -> KVPeer:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = self._sender.connect(address, timeout=self.cfg.push_timeout_s)
        return peer

    def _reap(self) -> None:
        now = time.monotonic()
        for push in self._pushes.values():
            for handle, layer, *_ in push.handles:
                if handle.state() is XferState.FAILED and push.error is None:
                    for address, *_ in push.reg.targets:
                        self._peers.pop(address, None)
                    self._fail(push, f"write of layer {layer} failed: {handle.error}")
            if push.error or push.done or push.reg is None or push.pending:
                if push.pending and now > push.deadline and push.error is None:
                    self._fail(push, "push still in flight at its deadline")
                continue
            end = min(push.reg.start_block + len(push.reg.block_ids), math.ceil(push.num_prompt_tokens / self.block_size))
            if all(s >= end for s in push.sent_blocks):
                self._complete(push, now)

    def _complete(self, push: _Push, now: float) -> None:
        push.done = True
        t0 = push.t_first_issue or now
        exposed = now - (push.t_prefill_done or now)

        def record(stats: Any) -> None:
            for _, _, t_issue, nbytes in push.handles:
                stats.record_layer(nbytes, now - t_issue)  # upper bound: reaped on a 2 ms tick
            stats.record_request(now - t0, exposed)

        self._record(record)
        self.timeline.append({
            "transfer_id": push.transfer_id, "layerwise": push.layerwise, "num_writes": len(push.handles),
            "t_prefill_start": push.t_created, "t_first_issue": t0, "t_prefill_done": push.t_prefill_done,
            "t_done": now,
        })
        logger.debug("KV push %s done: %d writes, %.1f ms, exposed %.1f ms", push.transfer_id,
                     len(push.handles), 1e3 * (now - t0), 1e3 * exposed)

    def _fail(self, push: _Push | None, reason: str) -> None:
        if push is not None and push.error is None and not push.done:
            push.error = reason
            logger.warning("KV push %s (request %s) abandoned: %s", push.transfer_id, push.req_id, reason)

    def _gc_registry(self, now: float) -> None:
        for tid, reg in list(self._registry.items()):
            if now - reg.t_arrival > max(reg.timeout_s, self.cfg.push_timeout_s):
                del self._registry[tid]
                logger.warning("KV push %s: registration expired, no prefill request with that id", tid)
        if len(self._rejected) > 4096:
            self._rejected.clear()
        for tid, (_, t) in list(self._cancelled.items()):
            if now - t <= _CANCELLED_TTL_S:
                break  # insertion order is arrival order
            del self._cancelled[tid]

    def _record(self, fn: Any) -> None:
        with self._stats_lock:
            fn(self._stats)

    def close(self) -> None:
        self._stop.set()
        self.server.close()
        self._thread.join(timeout=2)
        try:
            self._sender.close()
        except (DisaggError, OSError) as err:
            logger.debug("KV sender close: %s", err)


def _targets(body: dict, num_kv_heads: int) -> tuple[tuple[str, int, int], ...]:
    """The registration's write targets (default: the decode worker's own receiver), checked.

    Side-channel bodies are flat, so `targets` is "ADDR,NUM_SHARDS,SHARD;ADDR,NUM_SHARDS,SHARD;..."."""
    raw = body.get("targets")
    if raw is None:
        return ((str(body["address"]), 1, 0),)
    items = raw.split(";") if isinstance(raw, str) else []
    if not 1 <= len(items) <= 64:
        raise ValueError(f"targets: expected 1..64 'ADDR,NUM_SHARDS,SHARD' separated by ';', got {raw!r}"[:200])
    out = []
    for item in items:
        address, num_shards, shard = item.rsplit(",", 2)  # ValueError when malformed: REJECT
        num_shards, shard = int(num_shards), int(shard)
        if not address or num_shards < 1 or num_kv_heads % num_shards or not 0 <= shard < num_shards:
            raise ValueError(f"target {address!r}: shard {shard} of {num_shards} does not split "
                             f"{num_kv_heads} KV heads")
        out.append((address, num_shards, shard))
    return tuple(out)


def encode_targets(targets: list[tuple[str, int, int]]) -> str:
    """`targets` for a REGISTER body (the decode side of `_targets`)."""
    return ";".join(f"{address},{num_shards},{shard}" for address, num_shards, shard in targets)


def _shard_writes(writes: list[BlockWrite], num_shards: int, shard: int) -> list[BlockWrite]:
    """KV-head slice `shard` of every block: block b of `[NB, H, ...]` viewed as NB*num_shards contiguous
    sub-blocks, of which b*num_shards + shard is this shard's heads (zero-copy)."""
    if num_shards == 1:
        return writes
    out = []
    for w in writes:
        src = w.src.view(w.src.shape[0] * num_shards, -1)
        out.append(BlockWrite(w.region, src, [b * num_shards + shard for b in w.src_block_ids], w.dst_block_ids))
    return out
