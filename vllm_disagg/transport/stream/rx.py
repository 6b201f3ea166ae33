# SPDX-License-Identifier: Apache-2.0
"""KV receiver over stream connections, shared by tcp (block bytes inline in the frame, landed with
recv_into straight into the registered blocks) and shm (the sender already copied the blocks into
our shared memory; the frame only carries ids and the notification).

Per connection: authenticate -> (shm: pass region fds) -> loop { read KV_WRITE, check it against
the region table, land the bytes, hand the chunk to the peer's sequencer }. A bad frame drops that
connection only; the listener keeps serving.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import Any

from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.base import KVReceiver, RegionInfo, TransportOptions, TransportStats
from vllm_disagg.transport.kv_common import (
    NotificationInbox,
    PeerSequencer,
    Region,
    pack_region_table,
    parse_hello,
    parse_write_meta,
    region_from_tensor,
    runs,
)
from vllm_disagg.transport.server import AuthServer
from vllm_disagg.transport.wire import T_BYE, T_KV_WRITE, SockStream, read_frame, send_error

logger = logging.getLogger(__name__)
_IDLE_POLL_S = 0.5
_FENCE_TTL_S, _MAX_FENCED = 600.0, 4096
_DRAIN_CHUNK = 1 << 20
_LANDING_SLICE_S = 0.05
"""A frame's bytes land in waits of at most this, so a fence waits a slice, not the rest of the frame:
at 16 KiB/s a frame of tens of KiB takes seconds (a slow-link give-up in the Lamina soak)."""


class StreamKVReceiver(NotificationInbox, KVReceiver):
    unix = False

    def __init__(self, options: TransportOptions, name: str):
        self.options = options
        self.name = name
        self.stats = TransportStats()
        self._init_inbox()
        self._regions: list[Region] = []
        self._infos: list[RegionInfo] = []
        self._peers: dict[bytes, PeerSequencer] = {}
        self._server: AuthServer | None = None
        self._closed = threading.Event()
        self._fence_lock = threading.Lock()
        self._fenced: dict[str, float] = {}  # transfer id -> when fenced: its later bytes are drained
        self._landing: dict[int, str] = {}  # id(stream) -> transfer id whose bytes it is landing now

    # Setup

    def register_region(self, name: str, tensor: Any) -> RegionInfo:
        if self._server is not None:
            raise ValueError("register_region() must be called before start()")
        if any(r.info.name == name for r in self._regions):
            raise ValueError(f"region {name!r} is already registered")
        tensor = self._prepare_tensor(tensor)
        region = region_from_tensor(name, tensor)
        self._regions.append(region)
        self._infos.append(region.info)
        return region.info

    def _prepare_tensor(self, tensor: Any) -> Any:
        return tensor

    def start(self) -> str:
        if self._server is None:
            self._server = AuthServer(
                token=self.options.auth_token.encode(),
                service=b"kv",
                serve=self._serve_conn,
                welcome_info=lambda hello: pack_region_table(self._infos),
                stats=self.stats,
                timeout_s=self.options.timeout_s,
                host=self.options.host,
                port=self.options.port,
                unix=self.unix,
            )
            logger.info(
                "KV receiver %s serving %d regions on %s", self.name, len(self._regions), self.address
            )
        return self.address

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("KV receiver not started")
        return self._server.address

    # Notifications

    # Per-connection loop

    def _serve_conn(self, stream: SockStream, hello: bytes) -> None:
        clean = False
        try:
            session_id, stream_idx, peer_name = parse_hello(hello, stream.peer)
            seqr = self._sequencer(session_id, peer_name)
            self._after_welcome(stream, stream_idx)
            while not self._closed.is_set():
                if not self._readable(stream):
                    continue
                ftype, meta, payload_len = read_frame(stream)
                if ftype == T_BYE:
                    clean = True
                    return
                if ftype != T_KV_WRITE:
                    raise ProtocolError(f"unexpected frame type {ftype} from {stream.peer} on a KV stream")
                self._on_write(stream, seqr, meta, payload_len)
        except ProtocolError as err:
            self.stats.record_rejected()
            logger.warning("KV receiver %s dropped %s: %s", self.name, stream.peer, err)
            send_error(stream, err)
        except (PeerLostError, TransportTimeout) as err:
            if not self._closed.is_set():
                logger.info("KV sender %s lost: %s", stream.peer, err)
        except DisaggError as err:
            logger.warning("KV receiver %s: connection %s failed: %s", self.name, stream.peer, err)
        finally:
            if not clean and not self._closed.is_set() and "seqr" in locals():
                with self._lock:
                    if seqr.name not in self._lost:
                        self._lost.append(seqr.name)
            stream.close()

    def _sequencer(self, session_id: bytes, peer_name: str) -> PeerSequencer:
        with self._lock:
            seqr = self._peers.setdefault(session_id, PeerSequencer(peer_name))
        if seqr.name != peer_name:
            raise ProtocolError(f"session reused with a different sender name {peer_name!r}")
        return seqr

    def _after_welcome(self, stream: SockStream, stream_idx: int) -> None:
        """Backend hook run right after authentication (shm passes region fds here)."""

    def _accepted_payloads(self, region_idx: int, nbytes: int) -> tuple[int, ...]:
        """Payload sizes a KV_WRITE of `nbytes` into this region may carry: the bytes inline
        (tcp), or 0 where the sender already copied them into the region (shm overrides)."""
        return (nbytes,)

    def _readable(self, stream: SockStream) -> bool:
        """Wait for the next frame in slices, so an idle sender is not an error but close() is seen."""
        try:
            ready, _, _ = select.select([stream.sock], [], [], _IDLE_POLL_S)
        except (OSError, ValueError):  # closed under us by close()
            raise PeerLostError(f"connection to {stream.peer} closed") from None
        return bool(ready)

    def _on_write(self, stream: SockStream, seqr: PeerSequencer, meta: bytearray, payload_len: int) -> None:
        m = parse_write_meta(meta, self._infos, stream.peer)
        block_nbytes = self._infos[m.region_idx].block_nbytes if len(m.dst_ids) else 0
        nbytes = len(m.dst_ids) * block_nbytes
        if payload_len not in self._accepted_payloads(m.region_idx, nbytes):
            raise ProtocolError(
                f"KV_WRITE from {stream.peer}: payload {payload_len} bytes, expected "
                f"{' or '.join(map(str, self._accepted_payloads(m.region_idx, nbytes)))}"
            )
        if payload_len and not self._begin_landing(stream, m.transfer_id):
            _drain(stream, payload_len)  # given up on: its blocks may belong to another request now
        elif payload_len:
            try:
                self._land_payload(stream, m, payload_len)
            finally:
                with self._fence_lock:
                    self._landing.pop(id(stream), None)
        self.stats.record_received(nbytes)
        for notif in seqr.chunk_done(m, nbytes):
            self.stats.record_received(0, notifications=1)
            self._notifs.put(notif)

    def _land_payload(self, stream: SockStream, m: Any, payload_len: int) -> None:
        """recv_into the write's blocks; once its transfer is fenced mid-frame, drain the rest."""
        blocks, num_left = self._regions[m.region_idx].blocks, payload_len
        for _, first, length in runs(m.dst_ids):
            view = memoryview(blocks[first : first + length]).cast("B")
            got = self._land(stream, view, m.transfer_id)
            num_left -= got
            if got < view.nbytes:
                _drain(stream, num_left)
                return

    def _land(self, stream: SockStream, view: memoryview, transfer_id: str) -> int:
        """Bytes landed in `view`: all of it, or fewer once `transfer_id` is fenced (no further byte of
        it touches the blocks). No byte for the stream's timeout is a timeout, as in one recv_into."""
        got, last = 0, time.monotonic()
        while got < view.nbytes:
            num = stream.recv_some_into(view[got:], _LANDING_SLICE_S)
            now = time.monotonic()
            if num:
                got, last = got + num, now
            elif now - last > stream.timeout:
                raise TransportTimeout(f"no data from {stream.peer} within {stream.timeout}s")
            if got < view.nbytes and self._fenced_mid_landing(stream, transfer_id):
                return got
        return got

    def _fenced_mid_landing(self, stream: SockStream, transfer_id: str) -> bool:
        with self._fence_lock:
            if transfer_id not in self._fenced:
                return False
            self._landing.pop(id(stream), None)
            return True

    def _begin_landing(self, stream: SockStream, transfer_id: str) -> bool:
        with self._fence_lock:
            if transfer_id in self._fenced:
                return False
            self._landing[id(stream)] = transfer_id
            return True

    exact_fence = True

    def fence(self, transfer_id: str) -> bool:
        """Bytes are landed here (recv_into), so a fence is exact: later writes of `transfer_id` are
        read off the socket and dropped. True once none of its writes is mid-landing: a frame that is
        stops landing within a slice (`_LANDING_SLICE_S`) and its rest is drained."""
        now = time.monotonic()
        with self._fence_lock:
            self._fenced[transfer_id] = now
            for tid in [t for t, at in self._fenced.items() if now - at > _FENCE_TTL_S]:
                del self._fenced[tid]
            while len(self._fenced) > _MAX_FENCED:
                del self._fenced[next(iter(self._fenced))]
            return transfer_id not in self._landing.values()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.close()


def _drain(stream: SockStream, num_bytes: int) -> None:
    """Read `num_bytes` of a frame's payload and drop them (the stream stays in step)."""
    scratch = memoryview(bytearray(min(num_bytes, _DRAIN_CHUNK)))
    while num_bytes:
        n = min(num_bytes, len(scratch))
        stream.recv_into(scratch[:n])
        num_bytes -= n
