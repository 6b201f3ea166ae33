# SPDX-License-Identifier: Apache-2.0
"""The receiver half of the rdma KV push: registered regions, one RC QP and ring per sender, and
the poller that turns landed notification slots into `Notification`s (kv.py: the design)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_disagg.errors import PeerLostError, ProtocolError
from vllm_disagg.transport.base import Notification, RegionInfo, TransportOptions
from vllm_disagg.transport.onesided.inbox import OneSidedReceiver, backoff
from vllm_disagg.transport.rdma import proto
from vllm_disagg.transport.rdma.kv import NOTIF_SLOTS, SERVICE, Region, register_memory, verbs_addr
from vllm_disagg.transport.rdma.ring import RingReader
from vllm_disagg.transport.rdma.verbs import RECV_WR_ID, Device, Endpoint, wc_status_name
from vllm_disagg.transport.wire import SockStream

logger = logging.getLogger(__name__)


class RdmaKVReceiver(OneSidedReceiver):
    SERVICE = SERVICE
    POLLER_NAME = "disagg-rdma-rx-poll"

    def __init__(self, options: TransportOptions, name: str):
        super().__init__(options, name)
        self._dev = Device.get()
        self._regions: list[Region] = []

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
        self._regions.append(Region(info, verbs_addr(mem, mr), mr, mem.keepalive))
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
            layer, nbytes, transfer_id = proto.parse_notif(body, peer.reader.next_seq, peer.name)
            self._ready.append(Notification(peer.name, transfer_id, layer, peer.reader.next_seq, nbytes))
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
