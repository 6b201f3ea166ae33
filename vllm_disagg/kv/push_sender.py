# SPDX-License-Identifier: Apache-2.0
"""Prefill side of the KV push (runs in the prefill worker): side channel + sender thread.

Lifecycle of one push (`Push`, keyed by req_id; the decode side knows it by transfer_id): README.md.

More: README.md, "push_sender.py".
"""


from __future__ import annotations

import threading
import time
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.config import KVTransferSection
from vllm_disagg.errors import DisaggError, HandshakeMismatch
from vllm_disagg.kv.handshake import (
    HandshakeInfo,
    MsgType,
    SideMsg,
    VersionMismatch,
    cancel_msg,
    check_compatible,
    decode_msg,
    encode_msg,
    handshake_body,
    legacy_reject,
    parse_groups,
)
from vllm_disagg.kv.layer_events import DONE, LayerEvent
from vllm_disagg.kv.metadata import DisaggConnectorMetadata
from vllm_disagg.kv.push_plan import (
    ALL_LAYERS,
    Push,
    PushPlan,
    Registration,
    WorkItem,
    shard_writes,
)
from vllm_disagg.kv.register_body import parse_registered_blocks, parse_targets
from vllm_disagg.kv.side_channel import SideChannelServer, call_once
from vllm_disagg.kv.spans import is_traced, record_push_span
from vllm_disagg.kv.stats import StatsSink
from vllm_disagg.transport import BlockWrite, KVPeer, Transport

__all__ = ["PushSender"]

logger = init_logger(__name__)
_EVENT_WAIT_S = 0.002
_VERIFY_WAIT_S = 5.0
_HINTS = {"kv_groups": (" (KV cache groups of each layer: vLLM's hybrid allocator is on one side only; a decode "
                        "model worker with remote attention runs one group, so start its prefill instances with "
                        "--disable-hybrid-kv-cache-manager)")}


class PushSender:
    """Owns the prefill worker's side channel (on `control`), KV sender (on `data`) and sender thread."""

    def __init__(self, control: Transport, data: Transport, handshake: HandshakeInfo, token: str, layers: list[Any],
                 cfg: KVTransferSection, stats: StatsSink):
        self.handshake, self.token, self.layers, self.cfg = handshake, token, layers, cfg
        self.block_size = handshake.block_size
        self._stats, self._stats_lock = stats
        self._cond = threading.Condition()
        self.plan = PushPlan(layers, self.block_size, cfg, parse_groups(handshake.kv_groups, len(layers)))
        self._stop = threading.Event()
        self._control = control
        self.server = SideChannelServer(control.listen_msg(), self._on_message)
        self.address = self.server.address
        self._sender = data.kv_sender(name=self.address)
        self._peers: dict[str, KVPeer] = {}
        self._issuing: set[str] = set()
        """req_ids whose writes the sender thread planned and is issuing (outside the lock)."""
        self.timeline = self.plan.timeline
        self._thread = threading.Thread(target=self._run, name="disagg-kv-sender", daemon=True)
        self._thread.start()
        logger.info("KV push side channel listening on %s", self.address)

    @property
    def _pushes(self) -> dict[str, Push]:
        return self.plan.pushes

    # ------------------------------------------------------------ engine thread
    def bind(self, meta: DisaggConnectorMetadata) -> None:
        with self._cond:
            self.plan.bind(meta)
            self._cond.notify()
        self._wait_quiet(meta.preempted_req_ids)

    def layer_saved(self, layer_idx: int, event: LayerEvent = DONE) -> None:
        """Layer `layer_idx` of this step's requests is written once `event` (`layer_events.py`) completes."""
        with self._cond:
            self.plan.layer_saved(layer_idx, event)
            self._cond.notify()

    def step_done(self, event: LayerEvent = DONE) -> None:
        """The forward pass is over: every layer of this step's requests is written once `event` completes."""
        with self._cond:
            self.plan.layer_saved(ALL_LAYERS, event)
            self.plan.step_reqs = []
            self._cond.notify()

    def finished_sending(self) -> set[str]:
        with self._cond:
            traced = [p for p in self.plan.pushes.values() if p.released and p.over and is_traced(p)]
            over = self.plan.finished()
        for push in traced:
            record_push_span(push, len(self.layers))
        return over

    def has_pending(self) -> bool:
        with self._cond:
            return bool(self.plan.pushes)

    def _wait_quiet(self, req_ids: list[str]) -> None:
        """Block (bounded) until no write of `req_ids` still reads blocks that are being reused.

        First until the sender thread has issued what it planned for them: a write planned before a
        CANCEL and issued after its ACK would land in blocks D has already freed."""
        deadline = time.monotonic() + self.cfg.push_timeout_s
        with self._cond:
            while self._issuing.intersection(req_ids) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
        for req_id in req_ids:
            push = self.plan.pushes.get(req_id)
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
            reason = str(msg.body.get("reason") or "push timeout")
            self._on_cancel(msg.transfer_id, reason, wait=not msg.body.get("fenced"))
            if not msg.body.get("relayed"):
                self._relay_cancel(msg.transfer_id, reason)
            return encode_msg(SideMsg(MsgType.CANCEL_ACK, {"transfer_id": msg.transfer_id}))
        if msg.type is MsgType.VERIFY:
            return encode_msg(self._on_verify(msg.transfer_id))
        if msg.type is MsgType.STATUS:
            with self._cond:
                state, why = self.plan.status(msg.transfer_id)
                timing = self.plan.prefill_timing(msg.transfer_id)
            return encode_msg(SideMsg(MsgType.STATE, {"transfer_id": msg.transfer_id, "state": state,
                                                      "message": why[:500], **timing}))
        logger.warning("KV side channel: unexpected %s from %s; ignored", msg.type.name, peer)
        return None

    def _on_register(self, msg: SideMsg, peer: str) -> SideMsg:
        transfer_id = msg.transfer_id
        try:
            check_compatible(self.handshake, msg.body, self.token, transfer_id, peer)
            block_ids, start_block, more_groups = parse_registered_blocks(msg.body, msg.block_ids, self.plan.num_groups)
            reg = Registration(str(msg.body["address"]), block_ids, start_block,
                               float(msg.body.get("push_timeout_s") or self.cfg.push_timeout_s),
                               int(msg.body["num_prompt_tokens"]), str(msg.body.get("prompt_digest") or ""),
                               targets=parse_targets(msg.body, self.handshake.num_kv_heads), trace=msg.trace,
                               verify=msg.body.get("verify") is True, more_groups=more_groups)
        except HandshakeMismatch as err:
            why = (f"KV handshake mismatch on {err.field!r}: prefill {self.address} has {err.local!r}, "
                   f"decode {msg.body.get('address', peer)} has {err.remote!r}{_HINTS.get(err.field, '')}")
            logger.error("KV push %s refused: %s", transfer_id, why)
            self._record(lambda s: s.record_handshake_failure())
            with self._cond:
                self.plan.reject(transfer_id, why)
            return SideMsg(MsgType.REJECT, {"transfer_id": transfer_id, "field": err.field, "message": why})
        except (KeyError, TypeError, ValueError) as err:
            return SideMsg(MsgType.REJECT, {"transfer_id": transfer_id, "field": "register", "message": repr(err)})
        with self._cond:
            self.plan.register(transfer_id, reg)
            self._cond.notify()
        logger.debug("KV push %s: decode registered %d blocks from %s", transfer_id, len(msg.block_ids), peer)
        return SideMsg(MsgType.ACCEPT, handshake_body(self.handshake, self.token, transfer_id))

    def _on_verify(self, transfer_id: str) -> SideMsg:
        """The pushed blocks' checksums (kept at completion); D asks once its last byte landed, which
        can be a moment before this side saw its last write complete: wait for that, bounded."""
        deadline = time.monotonic() + min(self.cfg.push_timeout_s, _VERIFY_WAIT_S)
        with self._cond:
            while (kept := self.plan.checksums.pop(transfer_id, None)) is None:
                push = self._pushes.get(self.plan.by_tid.get(transfer_id, ""))
                left = deadline - time.monotonic()
                if push is None or push.error is not None or push.done or left <= 0:
                    why = push.error if push is not None and push.error else "unknown, expired or not completed"
                    return SideMsg(MsgType.REJECT, {"transfer_id": transfer_id, "field": "verify",
                                                    "message": f"no checksums for push {transfer_id}: {why}"[:500]})
                self._cond.wait(min(left, 0.05))
        return SideMsg(MsgType.CHECKSUMS, {"transfer_id": transfer_id, "crc32": kept[0]})

    def _on_cancel(self, transfer_id: str, reason: str, wait: bool = True) -> None:
        with self._cond:
            push = self.plan.cancel(transfer_id, reason)
            self._cond.notify()
        if push is not None and wait:
            self._wait_quiet([push.req_id])

    def _relay_cancel(self, transfer_id: str, reason: str) -> None:
        """Rank 0 of a TP > 1 prefill instance passes a CANCEL on to its other ranks (kv_port + r, same
        host), each holding its KV-head slice of the push's blocks: the router knows only kv_port. A
        decode rank's own CANCEL to its rank arrives twice then, which cancelling allows."""
        info = self.handshake
        if info.tp_rank != 0 or info.tp_size <= 1:
            return
        host, _, port = self.address.rpartition(":")
        targets = [f"{host}:{int(port) + rank}" for rank in range(1, info.tp_size)]
        threading.Thread(target=self._send_cancels, args=(targets, transfer_id, reason),
                         name="disagg-kv-cancel-relay", daemon=True).start()

    def _send_cancels(self, targets: list[str], transfer_id: str, reason: str) -> None:
        for address in targets:
            try:
                call_once(self._control.connect_msg, address, cancel_msg(transfer_id, reason, relayed=True), 2.0)
            except (DisaggError, OSError) as err:  # that rank frees the blocks at its push timeout
                logger.info("KV push %s: CANCEL not passed on to rank at %s (%s)", transfer_id, address, err)

    # ------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._idle()
            with self._cond:
                self.plan.promote_ready()
                work: list[WorkItem] = self.plan.plan()
                self._issuing = {push.req_id for push, _, _ in work}
            try:
                for push, writes, layer in work:
                    with self._cond:
                        if push.error is not None:  # cancelled or failed since planned: write nothing more
                            continue
                    self._issue(push, writes, layer)
            finally:
                with self._cond:
                    self._issuing = set()
                    self._cond.notify_all()
                    self._reap()

    def _idle(self) -> None:
        """Wait for the oldest saved layer's event (outside the lock: the forward stream is running),
        or else for new work."""
        with self._cond:
            oldest = self.plan.oldest_unready()
            if oldest is None:
                self._cond.wait(0.002 if self.plan.busy() else 0.05)
                return
        oldest.wait(_EVENT_WAIT_S)

    def _issue(self, push: Push, writes: list[BlockWrite], layer: int) -> None:
        for address, num_shards, shard in push.reg.targets:
            if not self._issue_to(push, shard_writes(writes, num_shards, shard), layer, address, num_shards):
                return

    def _issue_to(self, push: Push, writes: list[BlockWrite], layer: int, address: str, num_shards: int) -> bool:
        nbytes = sum(len(w.src_block_ids) for w in writes) * self.handshake.block_nbytes // num_shards
        try:
            peer = self._peer(address, check=not push.handles)  # once per push, not per layer
            handle = peer.write_blocks(writes, push.transfer_id, layer)
        except (DisaggError, OSError, ValueError) as err:
            self._drop_peer(address)
            with self._cond:
                self.plan.fail(push, f"write to {address} failed: {err}")
            return False
        with self._cond:
            self.plan.issued(push, handle, layer, nbytes)
        return True

    def _peer(self, address: str, check: bool = False) -> KVPeer:
        """The connection to `address`; with `check`, a new one if the cached one broke (a decode
        instance restarted on the same address: the old streams would fail this push, D would wait)."""
        peer = self._peers.get(address)
        if peer is not None and check and not peer.usable():
            logger.info("KV peer %s: the old connection is broken; reconnecting", address)
            self._drop_peer(address)
            peer = None
        if peer is None:
            peer = self._peers[address] = self._sender.connect(address, timeout=self.cfg.push_timeout_s)
        return peer

    def _drop_peer(self, address: str) -> None:
        """Forget the connection to `address` and close it off this thread (its stream threads and sockets
        would stay otherwise: found by the chaos run, +2 threads in P per decode restart); close is bounded."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            threading.Thread(target=peer.close, name="disagg-kv-peer-close", daemon=True).start()

    def _reap(self) -> None:
        """Called holding the lock; a verified push's checksums are computed without it (a CRC over
        every layer of its blocks would stall the engine thread's saves and the side channel)."""
        completed, suspect, to_checksum = self.plan.reap()
        if to_checksum:
            self._cond.release()
            try:
                sums = [(push, self.plan.block_checksums(push)) for push in to_checksum]
            finally:
                self._cond.acquire()
            completed += [push for push, crc in sums if self.plan.complete_verified(push, crc)]
        for address in suspect:
            self._drop_peer(address)
        for push in completed:
            self._record_done(push)

    def _record_done(self, push: Push) -> None:
        now = push.t_done
        t0 = push.t_first_issue or now
        exposed = now - (push.t_prefill_done or now)

        def record(stats: Any) -> None:
            for _, _, t_issue, nbytes in push.handles:
                stats.record_layer(nbytes, now - t_issue)  # upper bound: reaped on a 2 ms tick
            stats.record_request(now - t0, exposed)

        self._record(record)

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
