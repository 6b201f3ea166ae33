# SPDX-License-Identifier: Apache-2.0
"""`shm` backend: same-host transfers through shared memory.

KV push, one copy: the receiver moves each registered tensor's storage into shared memory *in
place* (torch's `share_memory_` machinery swaps the storage's data pointer, so every existing view,
vLLM's included, stays valid) and passes the fds over its unix socket (SCM_RIGHTS). The sender maps
them and copies blocks straight into the receiver's KV cache, in the thread that calls
`write_blocks`; the small KV_WRITE frame that follows carries ids and the notification, on the same
socket, in order. Where the kernel refuses (no room in
/dev/shm, fds dropped, mmap fails) that region's bytes travel inline on the socket instead (two
copies, as tcp), with a warning; nothing fails.
Messages: a ring pair in a memfd with eventfd wake-ups (`ring.py`); the unix socket stays open as
the liveness signal. Addresses are abstract unix socket names (`@vllm-disagg-...`).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
from typing import Any

import numpy as np

from vllm_disagg.errors import PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.base import (
    MsgChannel,
    MsgListener,
    RegionInfo,
    Transport,
    TransportKind,
)
from vllm_disagg.transport.kv_common import PlannedWrite, joint_runs, pack_write_meta
from vllm_disagg.transport.msg import SockMsgListener, StreamMsgChannel
from vllm_disagg.transport.shm.ring import attach_rings, create_rings
from vllm_disagg.transport.stream.rx import StreamKVReceiver
from vllm_disagg.transport.stream.tx import StreamKVPeer, StreamKVSender
from vllm_disagg.transport.tcp import connect_msg_stream
from vllm_disagg.transport.wire import (
    FRAME_HDR,
    MAX_META_BYTES,
    T_KV_WRITE,
    T_SHM_SETUP,
    SockStream,
    check_frame_crc,
    pack_frame,
    parse_frame_header,
)

__all__ = ["ShmTransport"]
logger = logging.getLogger(__name__)
MAX_FDS = 250  # below the kernel's SCM_MAX_FD (253)
_REGION_MAP = struct.Struct("<IQQ")  # fd index, byte offset in that fd, nbytes
NOT_SHARED = 0xFFFFFFFF  # fd index of a region that stayed in private memory: send it inline


class ShmKVReceiver(StreamKVReceiver):
    unix = True

    def __init__(self, options, name):
        super().__init__(options, name)
        self._fds: list[int] = []  # owned by torch's allocators; we only pass them on
        self._fd_of_storage: dict[int, int] = {}
        self._maps: list[tuple[int, int, int]] = []

    def _prepare_tensor(self, tensor: Any) -> Any:
        if tensor.device.type != "cpu":
            raise ValueError(f"shm backend needs CPU tensors, got {tensor.device} (GPU would need CUDA IPC)")
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._fd_of_storage and len(self._fds) >= MAX_FDS:
            raise ValueError(f"shm backend supports at most {MAX_FDS} distinct storages")
        try:
            fd, _ = storage._share_fd_cpu_()  # moves the storage into shared memory in place
        except RuntimeError as err:  # e.g. /dev/shm too small (containers default to 64 MiB)
            logger.warning("shm: region stays in private memory, its KV travels inline (2 copies): %s", err)
            self._maps.append((NOT_SHARED, 0, nbytes))
            return tensor
        key = storage.data_ptr()
        if key not in self._fd_of_storage:
            self._fd_of_storage[key] = len(self._fds)
            self._fds.append(fd)
        self._maps.append((self._fd_of_storage[key], tensor.data_ptr() - key, nbytes))
        return tensor

    def _after_welcome(self, stream: SockStream, stream_idx: int) -> None:
        meta = struct.pack("<I", len(self._fds)) + b"".join(_REGION_MAP.pack(*m) for m in self._maps)
        socket.send_fds(stream.sock, [pack_frame(T_SHM_SETUP, meta)], self._fds)

    def _accepted_payloads(self, region_idx: int, nbytes: int) -> tuple[int, ...]:
        """0: the sender copied the blocks into our shared region; nbytes: it could not map it."""
        return (0, nbytes) if self._maps[region_idx][0] != NOT_SHARED else (nbytes,)


class ShmKVPeer(StreamKVPeer):
    def __init__(self, address, streams, infos, options, stats, dst_blocks: list[np.ndarray | None]):
        self._dst = dst_blocks
        self.inline_regions = [info.name for info, dst in zip(infos, dst_blocks, strict=True) if dst is None]
        super().__init__(address, streams, infos, options, stats)

    def _before_queue(self, plans: list[PlannedWrite]) -> None:
        """Copy the blocks into the receiver's mapped KV cache here, in the caller's thread (numpy
        drops the GIL while it copies). Handing each copy to the stream thread cost a GIL hand-off
        per write: 64 MiB as 32 writes, stop 46, shm/memcpy 0.62 against 0.66 in paired full
        transport_bench runs (0.56 against 0.71, medians, with only memcpy beside it). The
        receiver cannot stall a copy, so the caller cannot hang here; only the small frame is
        queued, and a CANCEL's fence (no write in flight) still holds once `write_blocks` returned."""
        for c in plans:
            dst = self._dst[c.region_idx]
            if dst is not None:
                for s, d, n in joint_runs(c.src_ids, c.dst_ids):
                    np.copyto(dst[d : d + n], c.src[s : s + n])

    def _send_chunk(
        self, stream: SockStream, seq, chunk_idx, num_chunks, layer, transfer_id_bytes, c: PlannedWrite
    ) -> None:
        if self._dst[c.region_idx] is None:  # the receiver's region is not mapped here: bytes inline, as tcp
            super()._send_chunk(stream, seq, chunk_idx, num_chunks, layer, transfer_id_bytes, c)
            return
        meta = pack_write_meta(seq, chunk_idx, num_chunks, layer, c.region_idx, transfer_id_bytes, c.dst_ids)
        stream.send_parts([pack_frame(T_KV_WRITE, meta, 0)])


class ShmKVSender(StreamKVSender):
    def __init__(self, options, name):
        super().__init__(options, name, num_streams=1)  # the memcpy is the bottleneck, not the socket

    def _make_peer(self, address: str, streams: list[SockStream], infos: list[RegionInfo]) -> ShmKVPeer:
        maps = _recv_region_maps(streams[0], len(infos))
        return ShmKVPeer(
            address, streams, infos, self.options, self.stats, _map_regions(maps, infos, address)
        )


def _recv_region_maps(stream: SockStream, num_regions: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The receiver's SHM_SETUP: region maps, and the fds (as many as the kernel let through)."""
    try:
        data, fds, flags, _ = socket.recv_fds(stream.sock, FRAME_HDR.size + MAX_META_BYTES, MAX_FDS)
    except (TimeoutError, BlockingIOError):
        raise TransportTimeout(f"no shm region fds from {stream.peer}") from None
    except OSError as err:
        raise PeerLostError(f"shm setup with {stream.peer} failed: {err}") from None
    try:
        if len(data) < FRAME_HDR.size:
            raise ProtocolError(f"short shm setup frame from {stream.peer}")
        ftype, meta_len, _ = parse_frame_header(data[: FRAME_HDR.size], stream.peer)
        meta = bytearray(data[FRAME_HDR.size :])
        if len(meta) < meta_len:
            meta += stream.recv_exact(meta_len - len(meta))
        check_frame_crc(data[: FRAME_HDR.size], meta[:meta_len], stream.peer)
        (num_fds,) = struct.unpack_from("<I", meta)
        maps = [_REGION_MAP.unpack_from(meta, 4 + i * _REGION_MAP.size) for i in range(num_regions)]
        bad_index = any(m[0] >= num_fds and m[0] != NOT_SHARED for m in maps)
        if ftype != T_SHM_SETUP or len(fds) > num_fds or bad_index:
            raise ProtocolError(
                f"bad shm setup from {stream.peer}: {num_fds} fds announced, {len(fds)} received"
            )
        if len(fds) < num_fds:  # MSG_CTRUNC: we are out of fds, or an LSM dropped them
            logger.warning(
                "shm: %d of %d region fds from %s arrived (flags %#x); its KV travels inline",
                len(fds),
                num_fds,
                stream.peer,
                flags,
            )
            maps = [(NOT_SHARED, 0, m[2]) for m in maps]
    except (struct.error, ProtocolError):
        for fd in fds:
            os.close(fd)
        raise
    return fds, maps


def _map_regions(fds_maps, infos: list[RegionInfo], peer: str) -> list[np.ndarray | None]:
    """Numpy block views of the receiver's regions; None where a region must travel inline."""
    fds, maps = fds_maps
    try:
        mms = [mmap.mmap(fd, os.fstat(fd).st_size) for fd in fds]
    except OSError as err:  # ENOMEM, RLIMIT_AS, ...
        logger.warning("shm: cannot map the KV regions of %s (%s); its KV travels inline", peer, err)
        mms, maps = [], [(NOT_SHARED, 0, m[2]) for m in maps]
    finally:
        for fd in fds:
            os.close(fd)
    out: list[np.ndarray | None] = []
    for info, (fd_idx, offset, nbytes) in zip(infos, maps, strict=True):
        if nbytes != info.num_blocks * info.block_nbytes:
            raise ProtocolError(f"shm region {info.name!r} from {peer}: {nbytes} bytes, table says otherwise")
        if fd_idx == NOT_SHARED:
            out.append(None)
            continue
        mm = mms[fd_idx]
        if offset + nbytes > len(mm):
            raise ProtocolError(f"shm region {info.name!r} from {peer} does not fit its mapping")
        flat = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset)
        out.append(flat.reshape(info.num_blocks, info.block_nbytes))
    return out


class ShmTransport(Transport):
    kind = TransportKind.SHM
    DOCTOR_NOTE = "same host"
    receiver_cls = ShmKVReceiver
    sender_cls = ShmKVSender

    @classmethod
    def unavailable_reason(cls) -> str | None:
        missing = [
            n
            for n, ok in [
                ("os.memfd_create", hasattr(os, "memfd_create")),
                ("os.eventfd", hasattr(os, "eventfd")),
                ("socket.send_fds", hasattr(socket, "send_fds")),
                ("AF_UNIX", hasattr(socket, "AF_UNIX")),
            ]
            if not ok
        ]
        return f"needs Linux with Python >= 3.10: missing {', '.join(missing)}" if missing else None

    def listen_msg(self) -> MsgListener:
        opts = self.options

        def make(stream: SockStream, hello: bytes) -> MsgChannel:
            ring = create_rings(stream.sock, stream.peer, opts.timeout_s, opts.spin_us)
            return StreamMsgChannel(ring, opts)

        return SockMsgListener(opts, unix=True, make_channel=make)

    def connect_msg(self, address: str, timeout: float | None = None) -> MsgChannel:
        timeout = self.options.timeout_s if timeout is None else timeout
        stream = connect_msg_stream(address, self.options.auth_token, timeout)
        try:
            ring = attach_rings(stream.sock, address, self.options.timeout_s, self.options.spin_us)
        except BaseException:
            stream.close()
            raise
        return StreamMsgChannel(ring, self.options)
