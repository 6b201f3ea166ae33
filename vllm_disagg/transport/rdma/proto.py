# SPDX-License-Identifier: Apache-2.0
"""What the `rdma` backend exchanges over the authenticated control channel, and the layout of
the rings RDMA WRITEs land in.

The control channel is the transport package's framed TCP stream (`wire.py`, `server.py`): the
client's AUTH hello carries its `QpInfo` (+ its credit word), the server's WELCOME carries its
`QpInfo`, its ring and, for KV, the region table with one rkey + base address per region. Only
after both sides proved the shared token are rkeys revealed. Everything is `struct`-packed and
bound-checked; nothing is pickled. Pure python (no numpy/torch) so the soft-RoCE VM can run it.

More: README.md, "proto.py".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from vllm_disagg.errors import ProtocolError
from vllm_disagg.transport.onesided.notif import (  # noqa: F401 - part of rdma's wire format
    MAX_TID_BYTES,
    NOTIF_BODY,
    NOTIF_SLOT_BYTES,
    pack_notif,
    parse_notif,
)

RDMA_PROTO_VERSION = 2  # 2: QpInfo carries flags (FLAG_IMM) in what was a pad byte
FLAG_IMM = 1
"""QpInfo flag: the sender completes block-run posts with RDMA_WRITE_WITH_IMM (imm = seq) instead
of a seqword WRITE; the receiver acknowledges by echoing it and posts receives for the CQEs."""
KNOWN_FLAGS = FLAG_IMM
SESSION_ID_BYTES = 16
MAX_NAME_BYTES = 256
MAX_REGIONS = 1 << 16

# version, qpn, psn, gid(16 raw bytes), path mtu enum, flags, slots, slot_bytes, ring addr/rkey
# (the peer writes there), credit addr/rkey (the peer returns credits there).
_QP_INFO = struct.Struct("<HII16sBBHIQIQI")
_HELLO_HEAD = struct.Struct("<16sH")  # session id, name length
_REGION = struct.Struct("<HIQQI")  # name_len, num_blocks, block_nbytes, addr, rkey

# Message fragment body: msg_seq, total_len, frag_offset, frag_len; data follows.
FRAG_HEAD = struct.Struct("<QQQI")
# Serialized message: header_len, num_payloads; then u64 lengths, header, payloads.
MSG_HEAD = struct.Struct("<IH")
SEQWORD = struct.Struct("<Q")


@dataclass(frozen=True)
class QpInfo:
    """One side's RC endpoint: where its QP is and where the other side may WRITE."""

    qpn: int
    psn: int
    gid: bytes
    mtu: int
    flags: int = 0
    slots: int = 0
    slot_bytes: int = 0
    ring_addr: int = 0
    ring_rkey: int = 0
    credit_addr: int = 0
    credit_rkey: int = 0

    def pack(self) -> bytes:
        return _QP_INFO.pack(
            RDMA_PROTO_VERSION,
            self.qpn,
            self.psn,
            self.gid,
            self.mtu,
            self.flags,
            self.slots,
            self.slot_bytes,
            self.ring_addr,
            self.ring_rkey,
            self.credit_addr,
            self.credit_rkey,
        )

    @classmethod
    def unpack_from(cls, raw: bytes, pos: int, peer: str) -> tuple[QpInfo, int]:
        if len(raw) - pos < _QP_INFO.size:
            raise ProtocolError(f"rdma QP info from {peer} truncated ({len(raw) - pos} bytes)")
        version, *fields = _QP_INFO.unpack_from(raw, pos)
        if version != RDMA_PROTO_VERSION:
            raise ProtocolError(f"rdma protocol version {version} from {peer}, expected {RDMA_PROTO_VERSION}")
        info = cls(*fields)
        if not 0 < info.qpn < (1 << 24) or not 1 <= info.mtu <= 5:
            raise ProtocolError(f"rdma QP info from {peer} is invalid (qpn {info.qpn}, mtu {info.mtu})")
        if info.flags & ~KNOWN_FLAGS:
            raise ProtocolError(f"rdma QP info from {peer} has unknown flags {info.flags:#x}")
        if info.slots > 1 << 16 or info.slot_bytes > 1 << 30:
            raise ProtocolError(f"rdma ring from {peer} too large ({info.slots} x {info.slot_bytes})")
        return info, pos + _QP_INFO.size


def pack_hello(session_id: bytes, name: str, info: QpInfo) -> bytes:
    raw_name = name.encode()[:MAX_NAME_BYTES]
    return _HELLO_HEAD.pack(session_id, len(raw_name)) + raw_name + info.pack()


def parse_hello(raw: bytes, peer: str) -> tuple[bytes, str, QpInfo]:
    if len(raw) < _HELLO_HEAD.size:
        raise ProtocolError(f"rdma hello from {peer} truncated ({len(raw)} bytes)")
    session_id, name_len = _HELLO_HEAD.unpack_from(raw)
    if name_len > MAX_NAME_BYTES:
        raise ProtocolError(f"rdma hello from {peer}: name of {name_len} bytes")
    pos = _HELLO_HEAD.size + name_len
    try:
        name = raw[_HELLO_HEAD.size : pos].decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"rdma hello from {peer}: name is not UTF-8") from None
    info, end = QpInfo.unpack_from(raw, pos, peer)
    if end != len(raw):
        raise ProtocolError(f"rdma hello from {peer}: {len(raw) - end} trailing bytes")
    return session_id, name, info


@dataclass(frozen=True)
class RemoteRegion:
    """A receiver region as the sender sees it: geometry plus where to WRITE (addr, rkey)."""

    name: str
    num_blocks: int
    block_nbytes: int
    addr: int
    rkey: int


def pack_regions(regions: list[RemoteRegion]) -> bytes:
    out = [struct.pack("<I", len(regions))]
    for r in regions:
        name = r.name.encode()
        out.append(_REGION.pack(len(name), r.num_blocks, r.block_nbytes, r.addr, r.rkey) + name)
    return b"".join(out)


def parse_regions(raw: bytes, pos: int, peer: str) -> list[RemoteRegion]:
    """The region table must fill `raw` from `pos` exactly."""
    try:
        (count,) = struct.unpack_from("<I", raw, pos)
        if count > MAX_REGIONS:
            raise ProtocolError(f"{peer} announced {count} rdma regions (max {MAX_REGIONS})")
        pos += 4
        out = []
        for _ in range(count):
            name_len, num_blocks, block_nbytes, addr, rkey = _REGION.unpack_from(raw, pos)
            pos += _REGION.size
            if name_len > MAX_NAME_BYTES or pos + name_len > len(raw):
                raise ProtocolError(f"rdma region table from {peer}: bad name length {name_len}")
            out.append(RemoteRegion(raw[pos : pos + name_len].decode(), num_blocks, block_nbytes, addr, rkey))
            pos += name_len
    except (struct.error, UnicodeDecodeError) as err:
        raise ProtocolError(f"malformed rdma region table from {peer}: {err}") from None
    if pos != len(raw):
        raise ProtocolError(f"rdma region table from {peer}: {len(raw) - pos} trailing bytes")
    return out
