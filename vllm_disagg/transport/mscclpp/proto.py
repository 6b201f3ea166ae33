# SPDX-License-Identifier: Apache-2.0
"""What the `mscclpp` backend exchanges over the authenticated control channel.

mscclpp's own objects (an `Endpoint`, each `RegisteredMemory`) travel as opaque blobs produced by
their `serialize()` (mscclpp's byte format, not pickle), each length-prefixed and bounded; the rest
is `struct`-packed. The sender's AUTH hello carries its endpoint and its credit word; the
receiver's WELCOME (sent only after both sides proved the token) carries its endpoint, its
notification ring and one blob per KV region. Pure python, shared with the host test fabric.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from vllm_disagg.errors import ProtocolError

MSCCLPP_PROTO_VERSION = 1
SESSION_ID_BYTES = 16
MAX_NAME_BYTES = 256
MAX_BLOB_BYTES = 64 << 10
MAX_REGIONS = 1 << 16

_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")


class Writer:
    """Append-only builder of a control payload."""

    def __init__(self):
        self.parts: list[bytes] = []

    def u16(self, v: int) -> Writer:
        self.parts.append(_U16.pack(v))
        return self

    def u32(self, v: int) -> Writer:
        self.parts.append(_U32.pack(v))
        return self

    def u64(self, v: int) -> Writer:
        self.parts.append(_U64.pack(v))
        return self

    def name(self, s: str) -> Writer:
        raw = s.encode()
        if len(raw) > MAX_NAME_BYTES:
            raise ValueError(f"name {s[:40]!r}... longer than {MAX_NAME_BYTES} bytes")
        return self.u16(len(raw)).raw(raw)

    def blob(self, b: bytes) -> Writer:
        if len(b) > MAX_BLOB_BYTES:
            raise ValueError(f"serialized mscclpp object of {len(b)} bytes (max {MAX_BLOB_BYTES})")
        return self.u32(len(b)).raw(b)

    def raw(self, b: bytes) -> Writer:
        self.parts.append(bytes(b))
        return self

    def bytes(self) -> bytes:
        return b"".join(self.parts)


class Reader:
    """Bound-checked reader: every read that runs past the end is a ProtocolError naming the peer."""

    def __init__(self, raw: bytes, peer: str, what: str):
        self.raw, self.pos, self.peer, self.what = raw, 0, peer, what

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.raw):
            raise ProtocolError(f"mscclpp {self.what} from {self.peer} truncated at byte {self.pos}")
        out = self.raw[self.pos : self.pos + n]
        self.pos += n
        return out

    def u16(self) -> int:
        return _U16.unpack(self._take(2))[0]

    def u32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self._take(8))[0]

    def name(self) -> str:
        n = self.u16()
        if n > MAX_NAME_BYTES:
            raise ProtocolError(f"mscclpp {self.what} from {self.peer}: name of {n} bytes")
        try:
            return self._take(n).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"mscclpp {self.what} from {self.peer}: name is not UTF-8") from None

    def blob(self) -> bytes:
        n = self.u32()
        if n > MAX_BLOB_BYTES:
            raise ProtocolError(f"mscclpp {self.what} from {self.peer}: blob of {n} bytes")
        return self._take(n)

    def end(self) -> None:
        if self.pos != len(self.raw):
            raise ProtocolError(
                f"mscclpp {self.what} from {self.peer}: {len(self.raw) - self.pos} trailing bytes"
            )

    def version(self) -> None:
        v = self.u16()
        if v != MSCCLPP_PROTO_VERSION:
            raise ProtocolError(
                f"mscclpp protocol version {v} from {self.peer}, expected {MSCCLPP_PROTO_VERSION}"
            )


@dataclass(frozen=True)
class Hello:
    session_id: bytes
    name: str
    endpoint: bytes
    credit_mem: bytes

    def pack(self) -> bytes:
        w = Writer().u16(MSCCLPP_PROTO_VERSION).raw(self.session_id).name(self.name)
        return w.blob(self.endpoint).blob(self.credit_mem).bytes()

    @classmethod
    def parse(cls, raw: bytes, peer: str) -> Hello:
        r = Reader(raw, peer, "hello")
        r.version()
        out = cls(r._take(SESSION_ID_BYTES), r.name(), r.blob(), r.blob())
        r.end()
        return out


@dataclass(frozen=True)
class RemoteRegion:
    name: str
    num_blocks: int
    block_nbytes: int
    mem: bytes


@dataclass(frozen=True)
class Welcome:
    endpoint: bytes
    ring_mem: bytes
    slots: int
    slot_bytes: int
    regions: list[RemoteRegion]

    def pack(self) -> bytes:
        w = Writer().u16(MSCCLPP_PROTO_VERSION).blob(self.endpoint).blob(self.ring_mem)
        w.u16(self.slots).u32(self.slot_bytes).u32(len(self.regions))
        for reg in self.regions:
            w.name(reg.name).u32(reg.num_blocks).u64(reg.block_nbytes).blob(reg.mem)
        return w.bytes()

    @classmethod
    def parse(cls, raw: bytes, peer: str) -> Welcome:
        r = Reader(raw, peer, "welcome")
        r.version()
        endpoint, ring_mem, slots, slot_bytes, count = r.blob(), r.blob(), r.u16(), r.u32(), r.u32()
        if not 1 <= slots or not 64 <= slot_bytes <= 1 << 20 or count > MAX_REGIONS:
            raise ProtocolError(f"mscclpp welcome from {peer}: ring {slots} x {slot_bytes}, {count} regions")
        regions = [RemoteRegion(r.name(), r.u32(), r.u64(), r.blob()) for _ in range(count)]
        r.end()
        if any(reg.num_blocks < 1 or reg.block_nbytes < 1 for reg in regions):
            raise ProtocolError(f"mscclpp welcome from {peer}: a region with no blocks or empty blocks")
        return cls(endpoint, ring_mem, slots, slot_bytes, regions)
