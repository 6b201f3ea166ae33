# SPDX-License-Identifier: Apache-2.0
"""Pieces of the KV push shared by every backend: region tables, hello, KV_WRITE meta, block runs,
and the per-peer sequencer that delivers notifications only when complete and in order."""

from __future__ import annotations

import queue
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_disagg.errors import ProtocolError, TransportTimeout
from vllm_disagg.transport.base import BlockWrite, Notification, RegionInfo
from vllm_disagg.transport.wire import KV_WRITE_META, MAX_TID_BYTES, as_byte_view

SESSION_ID_BYTES = 16
MAX_NAME_BYTES = 256
MAX_REGIONS = 1 << 16
MAX_INFLIGHT_SEQS = 1 << 16
_HELLO = struct.Struct("<16sH")
_REGION = struct.Struct("<HIQ")


@dataclass
class Region:
    """A receiver-side region: its info plus a `[num_blocks, block_nbytes]` uint8 view of its memory."""

    info: RegionInfo
    tensor: Any
    blocks: np.ndarray


def region_from_tensor(name: str, tensor: Any) -> Region:
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"region name must be 1..{MAX_NAME_BYTES} bytes, got {name!r}")
    if tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(
            f"region {name!r} must be [num_blocks, ...] with num_blocks >= 1, got {tuple(tensor.shape)}"
        )
    blocks = block_view(tensor)
    return Region(RegionInfo(name, blocks.shape[0], blocks.shape[1]), tensor, blocks)


def block_view(tensor: Any) -> np.ndarray:
    """`[num_blocks, block_nbytes]` uint8 numpy view sharing the tensor's memory."""
    flat = np.frombuffer(as_byte_view(tensor), dtype=np.uint8)
    return flat.reshape(int(tensor.shape[0]), -1)


def pack_region_table(infos: list[RegionInfo]) -> bytes:
    out = [struct.pack("<I", len(infos))]
    for r in infos:
        name = r.name.encode()
        out.append(_REGION.pack(len(name), r.num_blocks, r.block_nbytes) + name)
    return b"".join(out)


def parse_region_table(raw: bytes, peer: str) -> tuple[list[RegionInfo], int]:
    """Returns (infos, bytes consumed)."""
    try:
        (count,) = struct.unpack_from("<I", raw)
        if count > MAX_REGIONS:
            raise ProtocolError(f"{peer} announced {count} regions (max {MAX_REGIONS})")
        pos, infos = 4, []
        for _ in range(count):
            name_len, num_blocks, block_nbytes = _REGION.unpack_from(raw, pos)
            pos += _REGION.size
            name = raw[pos : pos + name_len].decode()
            pos += name_len
            infos.append(RegionInfo(name, num_blocks, block_nbytes))
    except (struct.error, UnicodeDecodeError) as err:
        raise ProtocolError(f"malformed region table from {peer}: {err}") from None
    return infos, pos


def pack_hello(session_id: bytes, stream_idx: int, name: str) -> bytes:
    return _HELLO.pack(session_id, stream_idx) + name.encode()[:MAX_NAME_BYTES]


def parse_hello(raw: bytes, peer: str) -> tuple[bytes, int, str]:
    if len(raw) < _HELLO.size or len(raw) > _HELLO.size + MAX_NAME_BYTES:
        raise ProtocolError(f"bad KV hello from {peer} ({len(raw)} bytes)")
    session_id, stream_idx = _HELLO.unpack_from(raw)
    try:
        return session_id, stream_idx, raw[_HELLO.size :].decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"bad sender name in KV hello from {peer}") from None


@dataclass
class WriteMeta:
    seq: int
    chunk_idx: int
    num_chunks: int
    layer: int
    region_idx: int
    transfer_id: str
    dst_ids: np.ndarray


def pack_write_meta(seq, chunk_idx, num_chunks, layer, region_idx, transfer_id_bytes: bytes, dst_ids: np.ndarray) -> bytes:
    head = KV_WRITE_META.pack(seq, chunk_idx, num_chunks, layer, region_idx, len(dst_ids), len(transfer_id_bytes))
    return head + transfer_id_bytes + dst_ids.astype("<u4", copy=False).tobytes()


def parse_write_meta(meta: bytes | bytearray, regions: list[RegionInfo], peer: str) -> WriteMeta:
    """Decode and bound-check a KV_WRITE meta against the registered regions."""
    if len(meta) < KV_WRITE_META.size:
        raise ProtocolError(f"KV_WRITE from {peer}: meta too short ({len(meta)} bytes)")
    seq, chunk_idx, num_chunks, layer, region_idx, num_blocks, transfer_id_len = KV_WRITE_META.unpack_from(meta)
    if transfer_id_len > MAX_TID_BYTES or len(meta) != KV_WRITE_META.size + transfer_id_len + 4 * num_blocks:
        raise ProtocolError(f"KV_WRITE from {peer}: meta length {len(meta)} inconsistent with its counts")
    if not 0 <= chunk_idx < num_chunks:
        raise ProtocolError(f"KV_WRITE from {peer}: chunk {chunk_idx} of {num_chunks}")
    if num_blocks and region_idx >= len(regions):
        raise ProtocolError(f"KV_WRITE from {peer}: region index {region_idx} of {len(regions)}")
    try:
        transfer_id = bytes(meta[KV_WRITE_META.size : KV_WRITE_META.size + transfer_id_len]).decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"KV_WRITE from {peer}: transfer_id is not UTF-8") from None
    ids = np.frombuffer(bytes(meta), dtype="<u4", count=num_blocks, offset=KV_WRITE_META.size + transfer_id_len)
    if num_blocks and int(ids.max()) >= regions[region_idx].num_blocks:
        raise ProtocolError(
            f"KV_WRITE from {peer}: block id {int(ids.max())} out of range for region "
            f"{regions[region_idx].name!r} ({regions[region_idx].num_blocks} blocks)"
        )
    return WriteMeta(seq, chunk_idx, num_chunks, layer, region_idx, transfer_id, ids)


_SMALL_RUN_CHECK = 256
"""Up to this many ids, a list comparison checks for a single run faster than the numpy path."""


def _one_run(ids: np.ndarray, num: int) -> bool:
    """Whether `ids` is one consecutive run: a layer's write usually is, and for a few dozen ids this
    costs ~4x less than the numpy path's per-call overhead (Python ints: uint32 ids cannot wrap)."""
    first = int(ids[0])
    return int(ids[-1]) - first == num - 1 and ids.tolist() == list(range(first, first + num))


def runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Consecutive runs in `ids`: (position in ids, first id, length)."""
    num = len(ids)
    if num == 0:
        return []
    if num <= _SMALL_RUN_CHECK and _one_run(ids, num):  # the common case (see _one_run)
        return [(0, int(ids[0]), num)]
    breaks = np.flatnonzero(np.diff(ids.astype(np.int64)) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(s), int(ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def joint_runs(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs where src and dst are both consecutive: (src first, dst first, length)."""
    num = len(src_ids)
    if num == 0:
        return []
    if num <= _SMALL_RUN_CHECK and _one_run(src_ids, num) and _one_run(dst_ids, num):
        return [(int(src_ids[0]), int(dst_ids[0]), num)]
    both = (np.diff(src_ids) == 1) & (np.diff(dst_ids) == 1)
    breaks = np.flatnonzero(~both) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src_ids)]))
    return [(int(src_ids[s]), int(dst_ids[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


@dataclass
class PlannedWrite:
    """A validated `BlockWrite`: region index, `[n, block_nbytes]` source view, id arrays."""

    region_idx: int
    src: np.ndarray
    src_ids: np.ndarray
    dst_ids: np.ndarray


def plan_writes(writes: list[BlockWrite], regions: dict[str, tuple[int, RegionInfo]]) -> list[PlannedWrite]:
    """Check a write against the peer's regions; ValueError names the problem (caller mistake)."""
    plans = []
    for w in writes:
        if w.region not in regions:
            raise ValueError(f"unknown region {w.region!r}; the peer registered {sorted(regions)[:8]}...")
        idx, info = regions[w.region]
        src = block_view(w.src)
        if src.shape[1] != info.block_nbytes:
            raise ValueError(
                f"region {w.region!r}: source block is {src.shape[1]} bytes, peer's is {info.block_nbytes}"
            )
        src_ids = np.asarray(w.src_block_ids, dtype=np.int64).reshape(-1)
        dst_ids = np.asarray(w.dst_block_ids, dtype=np.int64).reshape(-1)
        if len(src_ids) != len(dst_ids):
            raise ValueError(
                f"region {w.region!r}: {len(src_ids)} source ids but {len(dst_ids)} destination ids"
            )
        if len(src_ids) and (src_ids.min() < 0 or src_ids.max() >= src.shape[0]):
            raise ValueError(f"region {w.region!r}: source block id out of range 0..{src.shape[0] - 1}")
        if len(dst_ids) and (dst_ids.min() < 0 or dst_ids.max() >= info.num_blocks):
            raise ValueError(
                f"region {w.region!r}: destination block id out of range 0..{info.num_blocks - 1}"
            )
        plans.append(PlannedWrite(idx, src, src_ids, dst_ids))
    return plans


def split_chunks(plans: list[PlannedWrite], chunk_bytes: int) -> list[PlannedWrite]:
    """Cut writes into frames of at most `chunk_bytes` (at least one block each)."""
    out = []
    for p in plans:
        per = max(1, chunk_bytes // max(1, p.src.shape[1]))
        for i in range(0, len(p.src_ids), per):
            out.append(PlannedWrite(p.region_idx, p.src, p.src_ids[i : i + per], p.dst_ids[i : i + per]))
    return out


class PeerSequencer:
    """Per-sender bookkeeping: a notification is released when all its chunks have landed and every
    earlier seq has been released."""

    def __init__(self, name: str):
        self.name = name
        self.next_seq = 0
        self._pending: dict[int, list] = {}  # seq -> [num_chunks, seen chunk set, transfer_id, layer, nbytes]
        self._lock = threading.Lock()

    def chunk_done(self, m: WriteMeta, nbytes: int) -> list[Notification]:
        with self._lock:
            if m.seq < self.next_seq or m.seq >= self.next_seq + MAX_INFLIGHT_SEQS:
                raise ProtocolError(
                    f"KV_WRITE from {self.name}: seq {m.seq} outside window at {self.next_seq}"
                )
            entry = self._pending.setdefault(m.seq, [m.num_chunks, set(), m.transfer_id, m.layer, 0])
            if entry[0] != m.num_chunks or entry[2] != m.transfer_id or entry[3] != m.layer:
                raise ProtocolError(f"KV_WRITE from {self.name}: chunks of seq {m.seq} disagree")
            if m.chunk_idx in entry[1]:
                raise ProtocolError(
                    f"KV_WRITE from {self.name}: duplicate chunk {m.chunk_idx} of seq {m.seq}"
                )
            entry[1].add(m.chunk_idx)
            entry[4] += nbytes
            return self._release()

    def _release(self) -> list[Notification]:
        ready = []
        while (e := self._pending.get(self.next_seq)) is not None and len(e[1]) == e[0]:
            del self._pending[self.next_seq]
            ready.append(Notification(self.name, e[2], e[3], self.next_seq, e[4]))
            self.next_seq += 1
        return ready


class NotificationInbox:
    """The receiver half the stream and NIXL KV receivers share: notifications handed out in the
    order they were delivered, and the names of senders whose connection broke (drained on read).

    Subclasses call `_init_inbox()` and have `options` and `address`."""

    def _init_inbox(self) -> None:
        self._notifs: queue.Queue[Notification] = queue.Queue()
        self._lost: list[str] = []
        self._lock = threading.Lock()

    def poll_notifications(self) -> list[Notification]:
        out = []
        while True:
            try:
                out.append(self._notifs.get_nowait())
            except queue.Empty:
                return out

    def wait_notification(self, timeout: float | None = None) -> Notification:
        timeout = self.options.timeout_s if timeout is None else timeout
        try:
            return self._notifs.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no KV notification on {self.address} within {timeout}s") from None

    def lost_peers(self) -> list[str]:
        with self._lock:
            out, self._lost = self._lost, []
        return out
