# SPDX-License-Identifier: Apache-2.0
"""The sender half of the rdma KV push: one RC QP per receiver, a worker per peer that posts
[data WRITEs..., notification, seqword] chains and reaps their completions (kv.py: the design)."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg import envs
from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.base import (
    BlockWrite,
    KVPeer,
    KVSender,
    RegionInfo,
    TransportOptions,
    TransportStats,
    XferHandle,
)
from vllm_disagg.transport.onesided.inbox import backoff
from vllm_disagg.transport.onesided.runs import plan_block_write
from vllm_disagg.transport.rdma import proto
from vllm_disagg.transport.rdma.kv import MAX_CHAIN_WRS, PEER_CHECK_S, SERVICE, register_memory, verbs_addr
from vllm_disagg.transport.rdma.ring import CreditWord, RingWriter
from vllm_disagg.transport.rdma.verbs import Device, Endpoint, memory_of, split_write, wc_status_name
from vllm_disagg.transport.wire import T_BYE, SockStream, client_handshake, connect_socket, pack_frame

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    seq: int
    transfer_id_bytes: bytes
    layer: int
    nbytes: int
    writes: list[tuple[int, int, int, int, int]]
    handle: XferHandle
    deadline: float
    keepalive: list = field(default_factory=list)
    posted: int = 0  # data WRs posted so far


class RdmaKVSender(KVSender):
    def __init__(self, options: TransportOptions, name: str, completion: str | None = None):
        completion = completion or envs.rdma_completion()
        if completion not in envs.RDMA_COMPLETIONS:
            raise ValueError(f"rdma completion {completion!r}: expected one of {envs.RDMA_COMPLETIONS}")
        self.options, self.name, self.completion = options, name, completion
        self.stats = TransportStats()
        self._dev = Device.get()
        self._mrs: dict[tuple[int, int], tuple[Any, Any]] = {}  # (addr, nbytes) -> (mr, keepalive)
        self._mr_lock = threading.Lock()
        self._peers: list[RdmaKVPeer] = []

    def connect(self, address: str, timeout: float | None = None) -> RdmaKVPeer:
        timeout = self.options.timeout_s if timeout is None else timeout
        stream = SockStream(connect_socket(address, timeout), address, timeout)
        credit, ep = CreditWord(self._dev), Endpoint(self._dev)
        try:
            flags = proto.FLAG_IMM if self.completion == "imm" else 0
            hello = proto.pack_hello(
                os.urandom(proto.SESSION_ID_BYTES), self.name, ep.info(flags=flags, **credit.fields())
            )
            welcome = client_handshake(stream, self.options.auth_token.encode(), SERVICE, hello)
            remote, pos = proto.QpInfo.unpack_from(welcome, 0, address)
            if remote.flags != flags:
                raise ProtocolError(
                    f"rdma kv receiver {address} answered completion flags {remote.flags:#x}, asked {flags:#x}"
                )
            regions = proto.parse_regions(welcome, pos, address)
            if remote.slot_bytes < proto.NOTIF_SLOT_BYTES:
                raise ProtocolError(
                    f"rdma kv receiver {address}: notification slots of {remote.slot_bytes} bytes"
                )
            writer = RingWriter(self._dev, remote, credit)
            ep.connect(remote)
        except BaseException:
            stream.close()
            ep.close()
            credit.close()
            raise
        peer = RdmaKVPeer(self, address, stream, ep, writer, regions)
        self._peers.append(peer)
        return peer

    def source_mr(self, obj: Any):
        """Register a source tensor once (the sender's KV cache); later calls hit the cache."""
        mem = memory_of(obj)
        key = (mem.addr, mem.nbytes)
        with self._mr_lock:
            hit = self._mrs.get(key)
            if hit is None:
                _, mr = register_memory(self._dev, obj, remote_write=False)
                hit = self._mrs[key] = (mr, mem.keepalive)
        return mem, hit[0]

    def close(self) -> None:
        for p in self._peers:
            p.close()
        self._peers = []
        with self._mr_lock:
            for mr, _ in self._mrs.values():
                mr.close()
            self._mrs = {}


class RdmaKVPeer(KVPeer):
    def __init__(
        self,
        sender: RdmaKVSender,
        address: str,
        stream: SockStream,
        ep: Endpoint,
        writer: RingWriter,
        regions,
    ):
        self._sender, self.address, self._stream, self._ep, self._writer = sender, address, stream, ep, writer
        self._remote = {r.name: r for r in regions}
        self.regions = {r.name: RegionInfo(r.name, r.num_blocks, r.block_nbytes) for r in regions}
        self._timeout = sender.options.timeout_s
        self._queue: collections.deque[_Job] = collections.deque()
        self._inflight: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._chains: collections.deque[tuple[int, int]] = collections.deque()  # (wr_id, WRs) posted
        self._outstanding = 0  # WRs in the send queue, retired when a later signalled WR completes
        self._error: DisaggError | None = None
        self._closing = False
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="disagg-rdma-kv-tx", daemon=True)
        self._worker.start()

    # ---- caller side -------------------------------------------------------------------------
    def write_blocks(self, writes: list[BlockWrite], transfer_id: str, layer: int = -1) -> XferHandle:
        transfer_id_bytes = transfer_id.encode()
        if len(transfer_id_bytes) > proto.MAX_TID_BYTES:
            raise ValueError(f"transfer_id must be <= {proto.MAX_TID_BYTES} bytes UTF-8")
        if self._closing:
            raise ValueError("write_blocks on a closed rdma peer")
        wrs, nbytes, keep = self._plan(writes)
        handle = XferHandle(nbytes, self._sender.stats)
        with self._cond:
            if self._error is not None:
                handle._finish(type(self._error)(f"peer {self.address} is broken: {self._error}"))
                return handle
            job = _Job(self._seq, transfer_id_bytes, layer, nbytes, wrs, handle, time.monotonic() + self._timeout, keep)
            self._seq += 1
            self._queue.append(job)
            self._cond.notify()
        return handle

    def _plan(self, writes: list[BlockWrite]) -> tuple[list, int, list]:
        """Check every BlockWrite (ValueError) and turn it into WRITEs of consecutive-block runs."""
        out, nbytes, keep = [], 0, []
        for w in writes:
            r = self._remote.get(w.region)
            if r is None:
                raise ValueError(
                    f"unknown region {w.region!r}; the peer registered {sorted(self._remote)[:8]}..."
                )
            mem, mr = self._sender.source_mr(w.src)
            runs = plan_block_write(w, mem.nbytes, mem.num_blocks, r.num_blocks, r.block_nbytes)
            bs = r.block_nbytes
            base = verbs_addr(mem, mr)
            for s, d, n in runs:
                out += split_write(base + s * bs, n * bs, mr.lkey, r.addr + d * bs, r.rkey)
                nbytes += n * bs
            keep.append(w.src)
        return out, nbytes, keep

    # ---- worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        idle, next_check = 0, 0.0
        while True:
            with self._cond:
                if self._closed or (self._closing and not self._queue and not self._inflight):
                    return
                if not self._queue and not self._inflight:
                    self._cond.wait(PEER_CHECK_S)
                job = self._queue[0] if self._queue else None
            try:
                busy = self._post(job) if job is not None and self._error is None else False
                busy |= self._reap()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + PEER_CHECK_S
                    self._check_alive(now)
            except DisaggError as err:
                self._fail(err)
                busy = True
            except Exception as err:  # pyverbs errors (post on a dead QP, ...) end the peer too
                self._fail(PeerLostError(f"rdma peer {self.address}: {type(err).__name__}: {err}"))
                busy = True
            idle = 0 if busy else idle + 1
            if self._inflight or self._queue:
                backoff(idle)

    def _post(self, job: _Job) -> bool:
        """Post the next chain of `job`; the final chain carries the notification + seqword."""
        room = self._ep.max_send_wr - self._outstanding
        remaining = len(job.writes) - job.posted
        if remaining > MAX_CHAIN_WRS:
            if room < MAX_CHAIN_WRS:
                return False
            chain = job.writes[job.posted : job.posted + MAX_CHAIN_WRS]
            self._ep.post_writes(chain, job.seq << 1)  # intermediate chain: signalled, wr_id even
            self._posted(job.seq << 1, len(chain))
            job.posted += len(chain)
            return True
        if room < remaining + 2 or not self._writer.has_room():
            return False
        body, imm = self._writer.body(), self._sender.completion == "imm"
        proto.pack_notif(body, job.seq, job.layer, job.nbytes, job.transfer_id_bytes)
        ring_seq = self._writer.next_seq
        tail = self._writer.writes(proto.NOTIF_BODY.size + len(job.transfer_id_bytes), seqword=not imm)
        chain = job.writes[job.posted :] + tail
        self._ep.post_writes(chain, (job.seq << 1) | 1, imm=ring_seq if imm else None)
        self._posted((job.seq << 1) | 1, len(chain))
        job.posted = len(job.writes)
        with self._cond:
            self._queue.popleft()
            self._inflight.append(job)
        return True

    def _posted(self, wr_id: int, nwr: int) -> None:
        self._chains.append((wr_id, nwr))
        self._outstanding += nwr

    def _reap(self) -> bool:
        done = self._ep.poll()
        for wr_id, status in done:
            if status:
                raise PeerLostError(
                    f"RDMA WRITE to {self.address} failed: {wc_status_name(status)} (QP now in error)"
                )
            while self._chains:  # RC completes in order: this retires every chain up to wr_id
                chain_id, nwr = self._chains.popleft()
                self._outstanding -= nwr
                if chain_id == wr_id:
                    break
            if wr_id & 1:
                with self._cond:
                    while self._inflight and self._inflight[0].seq <= wr_id >> 1:
                        self._inflight.popleft().handle._finish()
        return bool(done)

    def _check_alive(self, now: float) -> None:
        with self._cond:
            oldest = self._inflight[0] if self._inflight else (self._queue[0] if self._queue else None)
        if oldest is not None and now > oldest.deadline:
            raise TransportTimeout(
                f"rdma write seq {oldest.seq} to {self.address} not completed within {self._timeout}s"
            )
        if not self._closing and self._stream.peer_closed():
            raise PeerLostError(f"rdma kv receiver {self.address} closed the control channel")

    def _fail(self, err: DisaggError) -> None:
        logger.warning("rdma kv peer %s failed: %s", self.address, err)
        self._ep.to_error()
        with self._cond:
            self._error = self._error or err
            jobs = list(self._inflight) + list(self._queue)
            self._inflight.clear()
            self._queue.clear()
        for j in jobs:
            j.handle._finish(type(err)(str(err)))

    def close(self) -> None:
        if self._closed:
            return
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._worker.join(timeout=self._timeout)
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._worker.is_alive():
            self._fail(
                TransportTimeout(f"close: writes to {self.address} still pending after {self._timeout}s")
            )
            self._worker.join(timeout=2)
        try:
            self._stream.send_parts([pack_frame(T_BYE)], timeout=1.0)
        except DisaggError:
            pass
        self._stream.close()
        self._ep.to_error()
        self._ep.close()
        self._writer.close()
        self._writer.credit.close()
