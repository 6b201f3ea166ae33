# SPDX-License-Identifier: Apache-2.0
"""The per-layer attention RPC between a model worker and one attention server.

Carried as `MsgChannel` messages (`vllm_disagg.transport`): a fixed struct header plus raw tensor
payloads (zero-copy on send). Nothing is pickled; the only structured payload is the JSON of the
INIT handshake. Every received frame is checked (magic, version, type, sizes) before use.

More: README.md, "wire.py".
"""

from __future__ import annotations

import ctypes
import enum
import json
import struct
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from vllm_disagg.attention.variants import KV_CACHE_DTYPES, LayerAttrs
from vllm_disagg.errors import ProtocolError
from vllm_disagg.observe.context import TRACE_CONTEXT_BYTES, TraceContext

PROTOCOL_VERSION = 4
MAGIC = b"LAMA"


class MsgType(enum.IntEnum):
    INIT = 1
    INIT_OK = 2
    ATTN = 3
    QPREV = 4
    KV = 5
    OUT = 6
    OUT_LSE = 7
    PING = 8
    PONG = 9
    ERROR = 10
    RESTORE = 11
    RESTORE_OK = 12
    CLAIM = 13
    CLAIM_OK = 14


class Flag(enum.IntFlag):
    HAS_META = 1
    HAS_REG = 2
    RESUME = 4  # INIT: the same model worker reconnecting (recovery), not a restarted one
    HAS_TRACE = 8  # INIT or HAS_META: a 25-byte trace context is the last payload


(INIT, INIT_OK, ATTN, QPREV, KV, OUT, OUT_LSE, PING, PONG, ERROR, RESTORE, RESTORE_OK, CLAIM,
 CLAIM_OK) = MsgType
TYPE_NAMES = {t: t.name for t in MsgType}
# plain ints: flags are tested on every layer frame, and IntFlag's operators run in Python
HAS_META, HAS_REG, RESUME, HAS_TRACE = (int(f) for f in Flag)
_KNOWN_FLAGS = HAS_META | HAS_REG | RESUME | HAS_TRACE
_BY_VALUE = MsgType._value2member_map_
KEY_BYTES = 16

# magic, version, then `Header`'s fields in its order (type, seq, flags, layer, ...): the struct's
# formats were written for another order, but pack and unpack agree (u32 seq, u64 flags)
_PREFIX = struct.Struct("<4sH")  # the same in every version
_HEADER = struct.Struct("<4sHHIQiIIIIf")
HEADER_SIZE = _HEADER.size
_pack, _unpack = _HEADER.pack, _HEADER.unpack
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# no real model comes near these; they keep a malformed INIT from allocating the machine away
_GEOMETRY_BOUNDS = {"num_layers": 4096, "num_heads": 4096, "num_kv_heads": 4096, "head_size": 4096,
                    "block_size": 1 << 16, "max_num_tokens": 1 << 20}
_MAX_OUT_BYTES = 4 << 30
_ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int32: 4, torch.int64: 8,
             torch.uint8: 1}


class Header(NamedTuple):
    """The fixed per-message header (a tuple: built and read once per layer, so kept cheap)."""

    mtype: MsgType
    seq: int = 0
    flags: int = 0
    layer: int = 0
    meta_id: int = 0
    num_tokens: int = 0
    num_reqs: int = 0
    num_cols: int = 0
    scale: float = 0.0

    def pack(self) -> bytes:
        return _pack(MAGIC, PROTOCOL_VERSION, *self)

    @property
    def has_meta(self) -> bool:
        return bool(self.flags & HAS_META)

    @property
    def has_reg(self) -> bool:
        return bool(self.flags & HAS_REG)

    @property
    def has_trace(self) -> bool:
        return bool(self.flags & HAS_TRACE)


def unpack_header(raw: bytes) -> Header:
    if len(raw) >= _PREFIX.size:
        magic, version = _PREFIX.unpack_from(raw)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"attention protocol version {version} from the peer, this side speaks "
                                f"{PROTOCOL_VERSION}: run the same vllm-disagg on model worker and attention servers")
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"attention header is {len(raw)} bytes, expected {HEADER_SIZE}")
    _, _, *fields = _unpack(raw)
    mtype = _BY_VALUE.get(fields[0])
    if mtype is None:
        raise ProtocolError(f"unknown message type {fields[0]}")
    if fields[2] & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown flags {fields[2]:#x} on {mtype.name}")
    fields[0] = mtype
    return Header._make(fields)


def encode_trace(trace: TraceContext | None) -> list[bytes]:
    """The HAS_TRACE payload (empty list when there is no trace)."""
    return [trace.to_bytes()] if trace is not None else []


def decode_trace(h: Header, bufs: list[memoryview]) -> tuple[TraceContext | None, list[memoryview]]:
    """Split off a HAS_TRACE frame's last payload: (its trace context, the other payloads)."""
    if not h.has_trace:
        return None, bufs
    if h.mtype is not MsgType.INIT and not h.has_meta:
        raise ProtocolError(f"a trace context travels only on INIT or step metadata, not {h.mtype.name}")
    if not bufs or bufs[-1].nbytes != TRACE_CONTEXT_BYTES:
        raise ProtocolError(f"HAS_TRACE: the last payload must be {TRACE_CONTEXT_BYTES} bytes")
    return TraceContext.from_bytes(bufs[-1], "the model worker"), bufs[:-1]


@dataclass(frozen=True)
class Geometry:
    """What one server's shard looks like; sent in INIT, fixed for the session. `kv_cache_dtype`
    and `layers` (one `LayerAttrs` per layer; empty = plain attention everywhere) say which
    attention variant each layer is (`variants.py`); an older server refuses them by name."""

    num_layers: int
    num_heads: int  # query heads of this shard
    num_kv_heads: int  # KV heads of this shard
    head_size: int
    block_size: int
    dtype: str
    max_num_tokens: int
    kv_cache_dtype: str = "auto"
    layers: tuple[LayerAttrs, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ProtocolError(f"dtype {self.dtype!r} not one of {sorted(DTYPES)}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_size", "block_size", "max_num_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ProtocolError(f"geometry.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ProtocolError(f"{self.num_heads} query heads not a multiple of {self.num_kv_heads} KV heads")
        for name, bound in _GEOMETRY_BOUNDS.items():
            if getattr(self, name) > bound:
                raise ProtocolError(f"geometry.{name}={getattr(self, name)} is over {bound}")
        out_bytes = self.max_num_tokens * self.num_heads * self.head_size * _ITEMSIZE[self.torch_dtype]
        if out_bytes > _MAX_OUT_BYTES:  # the server allocates one reply buffer of this size per session
            raise ProtocolError(f"geometry asks for a {out_bytes}-byte output buffer (max {_MAX_OUT_BYTES})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ProtocolError(f"kv_cache_dtype {self.kv_cache_dtype!r} not one of {KV_CACHE_DTYPES}")
        layers = tuple(a if isinstance(a, LayerAttrs) else LayerAttrs.from_dict(a) for a in self.layers)
        object.__setattr__(self, "layers", layers)
        if layers and len(layers) != self.num_layers:
            raise ProtocolError(f"{len(layers)} layer attribute sets for {self.num_layers} layers")
        for i, a in enumerate(layers):
            if a.num_head_values() - {self.num_heads}:
                raise ProtocolError(f"layer {i}: per-head attributes must have {self.num_heads} values")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model dtype, or bytes for an fp8 cache (as vLLM's CPU cache)."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else torch.uint8

    def layer(self, index: int) -> LayerAttrs:
        return self.layers[index] if self.layers else _PLAIN

    @property
    def plain(self) -> bool:
        """Plain causal attention on every layer, model-dtype cache (what the torch paths implement)."""
        return self.kv_cache_dtype == "auto" and all(a.is_plain for a in self.layers)

    def as_dict(self) -> dict:
        """JSON-ready fields (a plain geometry without the keys older peers do not know)."""
        out = dict(self.__dict__)
        out["layers"] = [asdict(a) for a in self.layers]
        if not self.layers:  # keep a plain INIT what it always was
            del out["layers"]
        if self.kv_cache_dtype == "auto":
            del out["kv_cache_dtype"]
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.as_dict()).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> Geometry:
        try:
            fields = json.loads(bytes(raw))
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            return cls(**fields)
        except (ValueError, TypeError) as err:
            raise ProtocolError(f"bad INIT geometry: {err}") from None


_PLAIN = LayerAttrs()


@dataclass
class StepMeta:
    """Batch layout of one forward step (the scheduler's block ids, not remapped)."""

    query_start_loc: torch.Tensor  # int32 [R+1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, C]
    slot_mapping: torch.Tensor  # int64 [T]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping]


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's own memory, ~5x cheaper than going through numpy (this
    runs for every tensor of every layer). The view does not keep `t` alive: use it only while the
    caller holds `t` (a send). Non-contiguous or device tensors are refused, as by the transport."""
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"tensor {tuple(t.shape)} on {t.device} is not a contiguous CPU tensor")
    n = t.nbytes
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def as_tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """View a received payload as a tensor after checking its size exactly."""
    numel = 1
    for s in shape:
        numel *= s
    itemsize = _ITEMSIZE.get(dtype) or torch.empty((), dtype=dtype).element_size()
    expect = numel * itemsize
    if buf.nbytes != expect:
        raise ProtocolError(f"{what}: payload is {buf.nbytes} bytes, expected {expect} for {shape}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def decode_meta(h: Header, bufs: list[memoryview], num_blocks: int, block_size: int) -> StepMeta:
    """Rebuild and range-check the step metadata carried in the last four payloads."""
    if len(bufs) != 4:
        raise ProtocolError(f"step metadata needs 4 payloads, got {len(bufs)}")
    r, c, t = h.num_reqs, h.num_cols, h.num_tokens
    meta = StepMeta(
        as_tensor(bufs[0], torch.int32, (r + 1,), "query_start_loc"),
        as_tensor(bufs[1], torch.int32, (r,), "seq_lens"),
        as_tensor(bufs[2], torch.int32, (r, c), "block_table"),
        as_tensor(bufs[3], torch.int64, (t,), "slot_mapping"),
    )
    qsl = meta.query_start_loc
    if int(qsl[0]) != 0 or int(qsl[-1]) != t or bool((qsl[1:] < qsl[:-1]).any()):
        raise ProtocolError(f"query_start_loc {qsl.tolist()[:8]} does not cover {t} tokens")
    if r and (int(meta.seq_lens.min()) < 1 or int(meta.seq_lens.max()) > c * block_size):
        raise ProtocolError(f"seq_lens outside [1, {c * block_size}] for a {c}-column block table")
    if meta.block_table.numel() and (int(meta.block_table.min()) < 0 or int(meta.block_table.max()) >= num_blocks):
        raise ProtocolError(f"block id out of range [0, {num_blocks})")
    if t and (int(meta.slot_mapping.min()) < -1 or int(meta.slot_mapping.max()) >= num_blocks * block_size):
        raise ProtocolError(f"slot id out of range [-1, {num_blocks * block_size})")
    return meta


def error_text(bufs: list[memoryview]) -> str:
    return bytes(bufs[0]).decode("utf-8", "replace") if bufs else "unknown error"


def encode_block_keys(block_ids, keys) -> list:
    """(block ids, 16-byte keys) as two payloads: int32 [n] and the keys back to back."""
    return [torch.tensor(list(block_ids), dtype=torch.int32), b"".join(keys)]


def decode_block_ids(buf: memoryview, num_blocks: int, what: str) -> list[int]:
    """Check and decode an int32 [n] block-id payload: at most `num_blocks` ids, in range, distinct."""
    if buf.nbytes % 4:
        raise ProtocolError(f"{what}: block ids payload is {buf.nbytes} bytes, not a multiple of 4")
    n = buf.nbytes // 4
    if n > num_blocks:
        raise ProtocolError(f"{what}: {n} entries, more than the {num_blocks} blocks of this server")
    ids = as_tensor(buf, torch.int32, (n,), f"{what} block ids").tolist()
    if n and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = next(b for b in ids if not 0 <= b < num_blocks)
        raise ProtocolError(f"{what}: block id {bad} out of range [0, {num_blocks})")
    if len(set(ids)) != n:
        raise ProtocolError(f"{what}: a block id appears twice")
    return ids


def decode_block_keys(bufs: list[memoryview], num_blocks: int, what: str) -> tuple[list[int], list[bytes]]:
    """Check and decode `encode_block_keys`' payloads: sizes, at most `num_blocks` entries, block
    ids in range and distinct."""
    if len(bufs) != 2:
        raise ProtocolError(f"{what}: block ids and keys need 2 payloads, got {len(bufs)}")
    ids_buf, keys_buf = bufs
    ids = decode_block_ids(ids_buf, num_blocks, what)
    n = len(ids)
    if keys_buf.nbytes != n * KEY_BYTES:
        raise ProtocolError(f"{what}: keys payload is {keys_buf.nbytes} bytes, expected {n} keys of "
                            f"{KEY_BYTES} bytes")
    raw = bytes(keys_buf)
    return ids, [raw[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(n)]
