# SPDX-License-Identifier: Apache-2.0
"""KV push over a `Fabric` (mscclpp connections on a GPU machine; `HostFabric` in CI).

Same protocol as the `rdma` backend (`../rdma/README.md`): per `write_blocks`, one `write` per run
of consecutive blocks into the receiver's registered KV region, then the notification body into
ring slot `seq % slots`, then `put_u64(seqword[slot], seq + 1)` (mscclpp `update_and_sync`),
all queued in order on one connection, then a bounded `flush`: the handle is DONE when it returns.
The receiver's poller reads each peer's next seqword, turns ready slots into `Notification`s in
seq order and returns credits with `put_u64` into the sender's credit word, so a sender never
overwrites an unread slot. The control channel is the package's HMAC-authenticated `AuthServer`;
it also carries liveness (EOF = peer gone). Every wait is bounded; errors are `DisaggError`s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

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
from vllm_disagg.transport.mscclpp import proto
from vllm_disagg.transport.mscclpp.fabric import Fabric, Link, LocalMemory, RemoteMemory, Ring
from vllm_disagg.transport.onesided.inbox import OneSidedReceiver, backoff
from vllm_disagg.transport.onesided.memory import memory_of
from vllm_disagg.transport.onesided.notif import MAX_TID_BYTES, NOTIF_BODY, NOTIF_SLOT_BYTES, parse_notif
from vllm_disagg.transport.onesided.runs import plan_block_write
from vllm_disagg.transport.wire import (
    T_BYE,
    SockStream,
    client_handshake,
    connect_socket,
    pack_frame,
)

logger = logging.getLogger(__name__)

SERVICE = b"mscclpp-kv"
NOTIF_SLOTS = 64
SEQWORD_BYTES = 8


def ring_bytes(slots: int, slot_bytes: int) -> int:
    """Ring layout: `slots` bodies of `slot_bytes`, then `slots` u64 seqwords (0 = never written)."""
    return slots * (slot_bytes + SEQWORD_BYTES)


def seqword_offset(slots: int, slot_bytes: int, seq: int) -> int:
    return slots * slot_bytes + (seq % slots) * SEQWORD_BYTES


def pack_notif_body(seq: int, layer: int, nbytes: int, transfer_id_bytes: bytes) -> bytes:
    return NOTIF_BODY.pack(seq, layer, nbytes, len(transfer_id_bytes)) + transfer_id_bytes


@dataclass
class _RxPeer:
    name: str
    link: Link
    ring: Ring
    credit: RemoteMemory
    stream: SockStream | None = None
    next_seq: int = 0
    returned: int = 0
    dead: bool = False


class MscclppKVReceiver(OneSidedReceiver):
    SERVICE = SERVICE
    POLLER_NAME = "disagg-mscclpp-rx"

    def __init__(self, options: TransportOptions, name: str, fabric_factory: Callable[[], Fabric]):
        super().__init__(options, name)
        self._fabric = fabric_factory()
        self._regions: list[tuple[RegionInfo, LocalMemory]] = []

    def register_region(self, name: str, tensor: Any) -> RegionInfo:
        if self._server is not None:
            raise ValueError("register_region must be called before start()")
        if (
            not name
            or len(name.encode()) > proto.MAX_NAME_BYTES
            or any(r.name == name for r, _ in self._regions)
        ):
            raise ValueError(f"region name {name!r} is empty, too long or already registered")
        num_blocks = int(tensor.shape[0]) if hasattr(tensor, "shape") else memoryview(tensor).shape[0]
        mem = self._fabric.register(tensor)
        if num_blocks < 1 or mem.nbytes % num_blocks:
            raise ValueError(f"region {name!r}: {mem.nbytes} bytes do not split into {num_blocks} blocks")
        info = RegionInfo(name, num_blocks, mem.nbytes // num_blocks)
        self._regions.append((info, mem))
        return info

    def _welcome(self, hello_raw: bytes) -> bytes:
        hello = proto.Hello.parse(hello_raw, "mscclpp kv sender")
        local, ep_blob = self._fabric.new_endpoint()
        link = self._fabric.connect(local, hello.endpoint, hello.name)
        credit = self._fabric.import_memory(hello.credit_mem, hello.name)
        if credit.nbytes < SEQWORD_BYTES:
            raise ProtocolError(f"mscclpp kv sender {hello.name!r}: credit word of {credit.nbytes} bytes")
        ring = self._fabric.ring(ring_bytes(NOTIF_SLOTS, NOTIF_SLOT_BYTES))
        with self._lock:
            self._peers[hello.session_id] = _RxPeer(hello.name, link, ring, credit)
        regions = [proto.RemoteRegion(i.name, i.num_blocks, i.block_nbytes, m.blob) for i, m in self._regions]
        return proto.Welcome(ep_blob, ring.mem.blob, NOTIF_SLOTS, NOTIF_SLOT_BYTES, regions).pack()

    def _session_id(self, hello: bytes) -> bytes:
        return hello[2 : 2 + proto.SESSION_ID_BYTES]  # after the u16 version

    def _drop(self, sid: bytes, why: str, lost: bool) -> None:
        with self._lock:
            peer = self._peers.get(sid)
            if peer is None or peer.dead:
                return
            self._harvest(peer)
            peer.dead = True
            if lost:
                self._lost.append(peer.name)
            self._cond.notify_all()
        (logger.warning if lost else logger.debug)("mscclpp kv sender %s dropped: %s", peer.name, why)
        if peer.stream is not None:
            peer.stream.close()

    def _poll_loop(self) -> None:
        idle = 0
        while not self._closed.is_set():
            with self._lock:
                peers = [(sid, p) for sid, p in self._peers.items() if not p.dead]
            busy = False
            for sid, peer in peers:
                try:
                    with self._lock:
                        got = self._harvest(peer)
                    if got:
                        busy = True
                        peer.link.put_u64(peer.credit, 0, peer.next_seq)  # credits back
                        peer.link.flush(self.options.timeout_s)
                        peer.returned = peer.next_seq
                except ProtocolError as err:
                    self.stats.record_rejected()
                    self._drop(sid, str(err), lost=True)
                except DisaggError as err:
                    self._drop(sid, str(err), lost=True)
            idle = 0 if busy else idle + 1
            backoff(idle)

    def _harvest(self, peer: _RxPeer) -> int:
        """Ready ring slots -> notifications, in seq order (caller holds the lock)."""
        n, slots, sb = 0, NOTIF_SLOTS, NOTIF_SLOT_BYTES
        while not peer.dead:
            seq = peer.next_seq
            if peer.ring.read_u64(seqword_offset(slots, sb, seq)) != seq + 1:
                break
            body = memoryview(peer.ring.read((seq % slots) * sb, sb))
            layer, nbytes, transfer_id = parse_notif(body, seq, peer.name)
            self._ready.append(Notification(peer.name, transfer_id, layer, seq, nbytes))
            self.stats.record_received(nbytes, 1)
            peer.next_seq += 1
            n += 1
        if n:
            self._cond.notify_all()
        return n

    def close(self) -> None:
        if not self._closed.is_set():
            self._stop()


class MscclppKVSender(KVSender):
    def __init__(self, options: TransportOptions, name: str, fabric_factory: Callable[[], Fabric]):
        self.options, self.name = options, name
        self.stats = TransportStats()
        self.fabric = fabric_factory()
        self._sources: dict[tuple[int, int], LocalMemory] = {}
        self._src_lock = threading.Lock()
        self._peers: list[MscclppKVPeer] = []

    def connect(self, address: str, timeout: float | None = None) -> MscclppKVPeer:
        timeout = self.options.timeout_s if timeout is None else timeout
        stream = SockStream(connect_socket(address, timeout), address, timeout)
        try:
            local, ep_blob = self.fabric.new_endpoint()
            credit = self.fabric.ring(SEQWORD_BYTES)
            hello = proto.Hello(os.urandom(proto.SESSION_ID_BYTES), self.name, ep_blob, credit.mem.blob)
            welcome = proto.Welcome.parse(
                client_handshake(stream, self.options.auth_token.encode(), SERVICE, hello.pack()), address
            )
            if welcome.slot_bytes < NOTIF_SLOT_BYTES:
                raise ProtocolError(f"mscclpp kv receiver {address}: slots of {welcome.slot_bytes} bytes")
            link = self.fabric.connect(local, welcome.endpoint, address)
            ring = self.fabric.import_memory(welcome.ring_mem, address)
            if ring.nbytes < ring_bytes(welcome.slots, welcome.slot_bytes):
                raise ProtocolError(f"mscclpp kv receiver {address}: ring memory of {ring.nbytes} bytes")
            regions = {r.name: (r, self.fabric.import_memory(r.mem, address)) for r in welcome.regions}
            staging = self.fabric.ring(welcome.slots * welcome.slot_bytes)
        except BaseException:
            stream.close()
            raise
        peer = MscclppKVPeer(self, address, stream, link, welcome, ring, regions, credit, staging)
        self._peers.append(peer)
        return peer

    def source(self, obj: Any) -> LocalMemory:
        """Register a source tensor once (the sender's KV cache); later calls hit the cache."""
        mem = memory_of(obj)
        key = (mem.addr, mem.nbytes)
        with self._src_lock:
            hit = self._sources.get(key)
            if hit is None:
                hit = self._sources[key] = self.fabric.register(obj)
        return hit

    def close(self) -> None:
        for p in self._peers:
            p.close()
        self._peers = []


class MscclppKVPeer(KVPeer):
    def __init__(self, sender, address, stream, link, welcome, ring, regions, credit: Ring, staging: Ring):
        self._sender, self.address, self._stream, self._link = sender, address, stream, link
        self._slots, self._slot_bytes = welcome.slots, welcome.slot_bytes
        self._ring, self._regions, self._credit, self._staging = ring, regions, credit, staging
        self.regions = {n: RegionInfo(n, r.num_blocks, r.block_nbytes) for n, (r, _) in regions.items()}
        self._timeout = sender.options.timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="disagg-mscclpp-tx")
        self._seq = 0
        self._error: DisaggError | None = None
        self._closed = False

    def write_blocks(self, writes: list[BlockWrite], transfer_id: str, layer: int = -1) -> XferHandle:
        transfer_id_bytes = transfer_id.encode()
        if len(transfer_id_bytes) > MAX_TID_BYTES:
            raise ValueError(f"transfer_id must be <= {MAX_TID_BYTES} bytes UTF-8")
        if self._closed:
            raise ValueError("write_blocks on a closed mscclpp peer")
        ops, nbytes = self._plan(writes)
        handle = XferHandle(nbytes, self._sender.stats)
        seq, self._seq = self._seq, self._seq + 1
        body = pack_notif_body(seq, layer, nbytes, transfer_id_bytes)
        self._pool.submit(self._run, seq, ops, body, handle, time.monotonic() + self._timeout, writes)
        return handle

    def _plan(self, writes: list[BlockWrite]) -> tuple[list, int]:
        ops, nbytes = [], 0
        for w in writes:
            if w.region not in self._regions:
                raise ValueError(
                    f"unknown region {w.region!r}; the peer registered {sorted(self._regions)[:8]}..."
                )
            remote, dst = self._regions[w.region]
            src = self._sender.source(w.src)
            num_blocks = int(w.src.shape[0]) if hasattr(w.src, "shape") else memoryview(w.src).shape[0]
            runs = plan_block_write(w, src.nbytes, num_blocks, remote.num_blocks, remote.block_nbytes)
            bs = remote.block_nbytes
            ops += [(dst, d * bs, src, s * bs, n * bs) for s, d, n in runs]
            nbytes += sum(n for _, _, n in runs) * bs
        return ops, nbytes

    def _run(self, seq: int, ops: list, body: bytes, handle: XferHandle, deadline: float, _keep) -> None:
        try:
            if self._error is not None:
                raise type(self._error)(f"peer {self.address} is broken: {self._error}")
            if self._stream.peer_closed():
                raise PeerLostError(f"mscclpp kv receiver {self.address} closed the control channel")
            for dst, dst_off, src, src_off, n in ops:
                self._link.write(dst, dst_off, src, src_off, n)
            self._wait_credit(seq, deadline)
            slot_off = (seq % self._slots) * self._slot_bytes
            self._staging.write_local(slot_off, body)
            self._link.write(self._ring, slot_off, self._staging.mem, slot_off, len(body))
            self._link.put_u64(self._ring, seqword_offset(self._slots, self._slot_bytes, seq), seq + 1)
            self._link.flush(max(0.001, deadline - time.monotonic()))
            handle._finish()
        except DisaggError as err:
            self._error = self._error or err
            handle._finish(err)
        except Exception as err:  # a fabric bug must still fail the handle, never leave it pending
            self._error = self._error or PeerLostError(f"{type(err).__name__}: {err}")
            handle._finish(self._error)

    def _wait_credit(self, seq: int, deadline: float) -> None:
        """Block until slot `seq % slots` was consumed by the receiver (credit word >= seq+1-slots)."""
        idle = 0
        while seq - self._credit.read_u64(0) >= self._slots:
            if time.monotonic() > deadline:
                raise TransportTimeout(f"mscclpp receiver {self.address} returned no ring credit in time")
            if self._stream.peer_closed():
                raise PeerLostError(f"mscclpp kv receiver {self.address} closed the control channel")
            idle += 1
            time.sleep(0 if idle < 20 else 1e-4)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            self._stream.send_parts([pack_frame(T_BYE)], timeout=1.0)
        except DisaggError:
            pass
        self._stream.close()
