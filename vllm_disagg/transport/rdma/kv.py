# SPDX-License-Identifier: Apache-2.0
"""KV push over RC queue pairs: one-sided RDMA WRITEs straight into the decode side's registered
KV cache, followed in the same post by a notification body + seqno WRITE into a per-peer ring.

Receiver: regions are registered once (`register_region`, an MR per KV tensor); `start()` opens
the authenticated control listener; each sender gets its own RC QP and ring. A poller thread
watches every peer's next seqword (CPU polling of host memory) and turns ready slots into
`Notification`s, in seq order, then returns credits by an RDMA WRITE.

Sender: `write_blocks` checks the call (ValueError), registers the source tensor once (cached
MR), turns block ids into runs of consecutive blocks and queues one job; a per-peer worker posts
[data WRITEs..., notification body, seqword] as one chain with only the seqword signalled. Its
completion (RC: acked, so everything before it landed) finishes the handle. A WC error, a closed
control socket or an expired deadline fails the handle with a `DisaggError`, never a hang.

Completion variants, chosen per sender (`completion=`, default `$VLLM_DISAGG_RDMA_COMPLETION`) and
announced in its hello (`proto.FLAG_IMM`, echoed by the receiver, which serves both kinds at once):
`seqword` ends the post with WRITE(body) + WRITE(seq+1) polled in memory (what a GPU kernel can
poll); `imm` ends it with WRITE_WITH_IMM(body, imm=seq) and the receiver takes the seq from its
receive CQE (correct under PCIe relaxed ordering, where the seqword is not).
"""

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
    Notification,
    RegionInfo,
    TransportOptions,
    TransportStats,
    XferHandle,
)
from vllm_disagg.transport.onesided.inbox import OneSidedReceiver, backoff
from vllm_disagg.transport.onesided.runs import block_runs, plan_block_write  # noqa: F401 (re-export)
from vllm_disagg.transport.rdma import proto
from vllm_disagg.transport.rdma.ring import CreditWord, RingReader, RingWriter
from vllm_disagg.transport.rdma.verbs import (
    RECV_WR_ID,
    Device,
    Endpoint,
    memory_of,
    split_write,
    wc_status_name,
)
from vllm_disagg.transport.wire import (
    T_BYE,
    SockStream,
    client_handshake,
    connect_socket,
    pack_frame,
)

logger = logging.getLogger(__name__)

SERVICE = b"rdma-kv"
NOTIF_SLOTS = 64
MAX_CHAIN_WRS = 128  # data WRs per post; longer jobs are posted in several chains
_PEER_CHECK_S = 0.1


@dataclass
class _Region:
    info: RegionInfo
    addr: int
    mr: Any
    keepalive: Any


def register_memory(dev: Device, obj: Any, remote_write: bool):
    """(HostMemory, MR) for a tensor/buffer; CUDA tensors go through the GPU-direct path."""
    mem = memory_of(obj)
    if mem.is_gpu:
        from vllm_disagg.transport.rdma.gpu import register_gpu_memory

        return mem, register_gpu_memory(dev, mem, remote_write)
    return mem, dev.register(mem.addr, mem.nbytes, remote_write)


def verbs_addr(mem, mr) -> int:
    """The address verbs use for `mem`: its virtual address, or the iova of a dmabuf MR."""
    return getattr(mr, "iova_base", mem.addr)


class RdmaKVReceiver(OneSidedReceiver):
    SERVICE = SERVICE
    POLLER_NAME = "disagg-rdma-rx-poll"

    def __init__(self, options: TransportOptions, name: str):
        super().__init__(options, name)
        self._dev = Device.get()
        self._regions: list[_Region] = []

    def register_region(self, name: str, tensor: Any) -> RegionInfo:
        if self._server is not None:
            raise ValueError("register_region must be called before start()")
        if (
            not name
            or len(name.encode()) > proto.MAX_NAME_BYTES
            or any(r.info.name == name for r in self._regions)
        ):
            raise ValueError(f"region name {name!r} is empty, too long or already registered")
        mem, mr = register_memory(self._dev, tensor, remote_write=True)
        if mem.nbytes % mem.num_blocks:
            raise ValueError(f"region {name!r}: {mem.nbytes} bytes do not split into {mem.num_blocks} blocks")
        info = RegionInfo(name, mem.num_blocks, mem.nbytes // mem.num_blocks)
        self._regions.append(_Region(info, verbs_addr(mem, mr), mr, mem.keepalive))
        return info

    def _welcome(self, hello: bytes) -> bytes:
        session_id, name, remote = proto.parse_hello(hello, "rdma kv sender")
        if not remote.credit_rkey:
            raise ProtocolError(f"rdma kv sender {name!r} sent no credit word")
        imm = bool(remote.flags & proto.FLAG_IMM)
        ep = Endpoint(self._dev, max_send_wr=64, max_recv_wr=NOTIF_SLOTS if imm else 1)
        reader = RingReader(self._dev, NOTIF_SLOTS, proto.NOTIF_SLOT_BYTES, imm=imm)
        try:
            if imm:  # one receive per ring slot, posted before the sender may write (it waits for us)
                ep.post_recvs(NOTIF_SLOTS)
            ep.connect(remote)
        except Exception as err:
            ep.close()
            reader.close()
            raise ProtocolError(f"cannot connect a QP to sender {name!r}: {err}") from None
        with self._lock:
            self._peers[session_id] = _RxPeer(name, ep, reader, remote)
        table = [
            proto.RemoteRegion(r.info.name, r.info.num_blocks, r.info.block_nbytes, r.addr, r.mr.rkey)
            for r in self._regions
        ]
        info = ep.info(flags=remote.flags & proto.FLAG_IMM, **reader.fields())
        return info.pack() + proto.pack_regions(table)

    def _session_id(self, hello: bytes) -> bytes:
        return hello[: proto.SESSION_ID_BYTES]

    def _on_active(self, peer) -> None:
        peer.active = True

    def _drop(self, session_id: bytes, why: str, lost: bool) -> None:
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None or peer.dead:
                return
            self._harvest(peer)  # notifications that landed before the peer went away still count
            peer.dead = True
            if lost:
                self._lost.append(peer.name)
            self._cond.notify_all()
        (logger.warning if lost else logger.debug)("rdma kv sender %s dropped: %s", peer.name, why)
        peer.ep.to_error()
        if peer.stream is not None:
            peer.stream.close()

    def _poll_loop(self) -> None:
        idle = 0
        while not self._closed.is_set():
            busy = False
            with self._lock:
                peers = [(sid, p) for sid, p in self._peers.items() if p.active and not p.dead]
            for sid, peer in peers:
                try:
                    busy |= self._poll_cq(peer)
                    with self._lock:
                        got = self._harvest(peer)
                    busy |= got > 0
                    if got:
                        peer.credit_wrs += peer.reader.return_credits(peer.ep, peer.remote)
                except ProtocolError as err:
                    self.stats.record_rejected()
                    self._drop(sid, str(err), lost=True)
                except Exception as err:  # DisaggError, or a pyverbs error from a broken QP
                    self._drop(sid, f"{type(err).__name__}: {err}", lost=True)
            idle = 0 if busy else idle + 1
            backoff(idle)

    def _poll_cq(self, peer: _RxPeer) -> bool:
        """Retire credit-WRITE completions; in imm mode also take receive CQEs (slot landed) and
        repost a receive for each, before credits go back, so the sender never meets an empty RQ."""
        wcs = peer.ep.poll_imm()
        landed = 0
        for wr_id, status, imm in wcs:
            if wr_id == RECV_WR_ID:
                if status:
                    raise PeerLostError(f"write-with-imm from {peer.name} failed: {wc_status_name(status)}")
                peer.reader.landed(imm, peer.name)
                landed += 1
                continue
            peer.credit_wrs -= 1
            if status:
                raise PeerLostError(f"credit WRITE to {peer.name} failed: {wc_status_name(status)}")
        if landed:
            peer.ep.post_recvs(landed)
        return bool(wcs)

    def _harvest(self, peer: _RxPeer) -> int:
        """Move the peer's ready ring slots into `_ready` (caller holds the lock)."""
        n = 0
        while not peer.dead and (body := peer.reader.peek()) is not None:
            layer, nbytes, tid = proto.parse_notif(body, peer.reader.next_seq, peer.name)
            self._ready.append(Notification(peer.name, tid, layer, peer.reader.next_seq, nbytes))
            peer.reader.consume()
            self.stats.record_received(nbytes, 1)
            n += 1
        if n:
            self._cond.notify_all()
        return n

    def close(self) -> None:
        if self._closed.is_set():
            return
        for p in self._stop():
            p.ep.to_error()
            p.ep.close()
            p.reader.close()
        for r in self._regions:
            r.mr.close()
        self._regions = []


@dataclass
class _RxPeer:
    name: str
    ep: Endpoint
    reader: RingReader
    remote: proto.QpInfo
    stream: SockStream | None = None
    active: bool = False
    dead: bool = False
    credit_wrs: int = 0


@dataclass
class _Job:
    seq: int
    tid: bytes
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
        tid = transfer_id.encode()
        if len(tid) > proto.MAX_TID_BYTES:
            raise ValueError(f"transfer_id must be <= {proto.MAX_TID_BYTES} bytes UTF-8")
        if self._closing:
            raise ValueError("write_blocks on a closed rdma peer")
        wrs, nbytes, keep = self._plan(writes)
        handle = XferHandle(nbytes, self._sender.stats)
        with self._cond:
            if self._error is not None:
                handle._finish(type(self._error)(f"peer {self.address} is broken: {self._error}"))
                return handle
            job = _Job(self._seq, tid, layer, nbytes, wrs, handle, time.monotonic() + self._timeout, keep)
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
                    self._cond.wait(_PEER_CHECK_S)
                job = self._queue[0] if self._queue else None
            try:
                busy = self._post(job) if job is not None and self._error is None else False
                busy |= self._reap()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + _PEER_CHECK_S
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
        proto.pack_notif(body, job.seq, job.layer, job.nbytes, job.tid)
        ring_seq = self._writer.next_seq
        tail = self._writer.writes(proto.NOTIF_BODY.size + len(job.tid), seqword=not imm)
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
