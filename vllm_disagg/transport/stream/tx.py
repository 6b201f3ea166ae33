# SPDX-License-Identifier: Apache-2.0
"""KV sender over stream connections, shared by tcp and shm.

`write_blocks` validates, cuts the copy into chunks, stamps them with the next seq and queues them
round-robin on the peer's streams; one thread per stream sends (tcp: sendmsg of the frame plus the
source blocks' own memory; shm: the caller has already copied the blocks into the receiver's mapped
region, `_before_queue`, and the thread sends only a small frame).
The handle is DONE once every chunk is out, FAILED with the first error: after a failure the
peer is dead and every later write fails at once (no silent retry).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence

import numpy as np

from vllm_disagg.errors import DisaggError, PeerLostError
from vllm_disagg.transport.base import (
    BlockWrite,
    KVPeer,
    KVSender,
    RegionInfo,
    TransportOptions,
    TransportStats,
    XferHandle,
)
from vllm_disagg.transport.kv_common import (
    SESSION_ID_BYTES,
    PlannedWrite,
    pack_hello,
    pack_write_meta,
    parse_region_table,
    plan_writes,
    runs,
    split_chunks,
)
from vllm_disagg.transport.wire import (
    MAX_TID_BYTES,
    T_BYE,
    T_KV_WRITE,
    SockStream,
    client_handshake,
    connect_socket,
    pack_frame,
)

logger = logging.getLogger(__name__)


class _Op:
    """One write_blocks call: done when all its chunks are out."""

    def __init__(self, handle: XferHandle, num_chunks: int):
        self.handle = handle
        self.left = num_chunks
        self.lock = threading.Lock()

    def chunk_sent(self) -> None:
        with self.lock:
            self.left -= 1
            done = self.left == 0
        if done:
            self.handle._finish()


class StreamKVPeer(KVPeer):
    def __init__(self, address: str, streams: list[SockStream], infos: list[RegionInfo], options, stats):
        self.address = address
        self.options = options
        self.stats = stats
        self.regions = {r.name: r for r in infos}
        self._index = {r.name: (i, r) for i, r in enumerate(infos)}
        self._streams = streams
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in streams]
        self._lock = threading.Lock()
        self._seq = 0
        self._rr = 0
        self._error: DisaggError | None = None
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"disagg-kv-tx-{i}", daemon=True)
            for i in range(len(streams))
        ]
        for t in self._threads:
            t.start()

    def write_blocks(self, writes: Sequence[BlockWrite], transfer_id: str, layer: int = -1) -> XferHandle:
        transfer_id_bytes = transfer_id.encode()
        if len(transfer_id_bytes) > MAX_TID_BYTES:
            raise ValueError(f"transfer_id longer than {MAX_TID_BYTES} bytes")
        plans = plan_writes(list(writes), self._index)
        chunks = split_chunks(plans, self.options.chunk_bytes) or [_empty_chunk()]
        nbytes = sum(len(c.src_ids) * c.src.shape[1] for c in chunks)
        handle = XferHandle(nbytes, self.stats)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"KV peer {self.address} is closed")
            if self._error is not None:
                handle._finish(self._error)
                return handle
            self._before_queue(plans)
            seq, self._seq = self._seq, self._seq + 1
            op = _Op(handle, len(chunks))
            for i, chunk in enumerate(chunks):
                self._queues[self._rr % len(self._queues)].put((op, seq, i, len(chunks), layer, transfer_id_bytes, chunk))
                self._rr += 1
        return handle

    def _before_queue(self, plans: list[PlannedWrite]) -> None:
        """Work done in the caller's thread before the chunks are queued: none for tcp."""

    def _run(self, idx: int) -> None:
        stream, jobs = self._streams[idx], self._queues[idx]
        while (job := jobs.get()) is not None:
            op = job[0]
            if self._error is not None:
                op.handle._finish(self._error)
                continue
            try:
                if stream.peer_closed():
                    raise PeerLostError(f"KV receiver {self.address} closed the connection")
                self._send_chunk(stream, *job[1:])
                op.chunk_sent()
            except DisaggError as err:
                self._fail(err)
                op.handle._finish(err)

    def _send_chunk(
        self, stream: SockStream, seq, chunk_idx, num_chunks, layer, transfer_id_bytes, c: PlannedWrite
    ) -> None:
        """tcp: frame + block bytes straight from the source tensor's memory."""
        meta = pack_write_meta(seq, chunk_idx, num_chunks, layer, c.region_idx, transfer_id_bytes, c.dst_ids)
        nbytes = len(c.src_ids) * c.src.shape[1]
        parts = [pack_frame(T_KV_WRITE, meta, nbytes)]
        parts += [c.src[first : first + n] for _, first, n in runs(c.src_ids)]
        stream.send_parts(parts)

    def _fail(self, err: DisaggError) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
                logger.info("KV peer %s failed: %s", self.address, err)

    def usable(self) -> bool:
        """A receiver that restarted on the same address closed our old streams: seen here as EOF."""
        return self._error is None and not self._closed and not any(s.peer_closed() for s in self._streams)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=self.options.timeout_s)
        for s in self._streams:
            if self._error is None:
                try:
                    s.send_parts([pack_frame(T_BYE)], timeout=1.0)
                except DisaggError:
                    pass
            s.close()


def _empty_chunk() -> PlannedWrite:
    """A write with no blocks still carries its notification."""
    empty = np.zeros(0, dtype=np.int64)
    return PlannedWrite(0, np.zeros((0, 1), dtype=np.uint8), empty, empty)


class StreamKVSender(KVSender):
    peer_cls = StreamKVPeer

    def __init__(self, options: TransportOptions, name: str, num_streams: int | None = None):
        self.options = options
        self.name = name
        self.num_streams = num_streams or options.num_streams
        self.stats = TransportStats()
        self._peers: list[KVPeer] = []

    def connect(self, address: str, timeout: float | None = None) -> KVPeer:
        timeout = self.options.timeout_s if timeout is None else timeout
        session = os.urandom(SESSION_ID_BYTES)
        streams: list[SockStream] = []
        try:
            for i in range(self.num_streams):
                stream = SockStream(connect_socket(address, timeout), address, timeout)
                info = client_handshake(
                    stream, self.options.auth_token.encode(), b"kv", pack_hello(session, i, self.name)
                )
                streams.append(stream)
                if i == 0:
                    infos, _ = parse_region_table(info, address)
            peer = self._make_peer(address, streams, infos)
        except BaseException:
            for s in streams:
                s.close()
            raise
        for s in streams:
            s.timeout = self.options.timeout_s
        self._peers.append(peer)
        logger.info(
            "KV sender %s connected to %s (%d streams, %d regions)",
            self.name,
            address,
            len(streams),
            len(infos),
        )
        return peer

    def _make_peer(self, address: str, streams: list[SockStream], infos: list[RegionInfo]) -> KVPeer:
        return StreamKVPeer(address, streams, infos, self.options, self.stats)

    def close(self) -> None:
        for p in self._peers:
            p.close()
        self._peers.clear()
