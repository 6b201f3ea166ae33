# SPDX-License-Identifier: Apache-2.0
"""Compatibility handshake and side-channel messages of the KV push (decode <-> prefill).

Before any KV byte moves, the decode worker sends REGISTER (its `HandshakeInfo`, the transfer id,
its receiver address and block ids) to the prefill worker's side channel. The prefill side checks
every field, in `HANDSHAKE_FIELDS` order, and answers ACCEPT (with its own info, which the decode
side checks too) or REJECT naming the first field that differs. CANCEL asks the prefill side to
stop a push (its push timed out, the request was aborted, or D took it over from the attention
servers' retained KV) and answers CANCEL_ACK once none of its writes are still in flight; a CANCEL
that arrives before the prefill request is remembered, so that push never starts. VERIFY (D, once
every byte landed, when REGISTER asked for `verify`) is answered with CHECKSUMS, one CRC32 per layer
of the blocks P pushed (transport/checksum.py), or REJECT when P has none for that transfer.

Versions: 1 the first; 2 added the trace context to the header; 3 added VERIFY and CHECKSUMS; 4 added
STATUS and STATE; 5 added KV cache groups (`kv_groups`, REGISTER's `more_groups`). A peer of an older
version gets a REJECT it can read (`legacy_reject`), naming both versions.

More: README.md, "handshake.py".
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from vllm_disagg.errors import HandshakeMismatch, ProtocolError
from vllm_disagg.observe.context import TRACE_CONTEXT_BYTES, TraceContext

__all__ = [
    "PROTOCOL_VERSION",
    "HANDSHAKE_FIELDS",
    "HandshakeInfo",
    "MsgType",
    "SideMsg",
    "cancel_msg",
    "VersionMismatch",
    "auth_proof",
    "check_compatible",
    "decode_msg",
    "encode_msg",
    "handshake_body",
    "legacy_reject",
    "local_handshake_info",
]

PROTOCOL_VERSION = 5
_MAGIC = b"DGKV"
_PREFIX = struct.Struct("!4sH")  # magic, version: the same in every version
_HEADER = struct.Struct("!4sHHIIB")
_HEADER_V1 = struct.Struct("!4sHHII")
MAX_BODY_BYTES = 8 << 10
MAX_BLOCK_IDS = 12 << 10  # the whole frame must fit a transport message header (64 KiB)


class MsgType(enum.IntEnum):
    REGISTER = 1
    ACCEPT = 2
    REJECT = 3
    CANCEL = 4
    CANCEL_ACK = 5
    VERIFY = 6
    CHECKSUMS = 7
    STATUS = 8
    """D -> P: how is push `transfer_id` doing? Asked when no byte of it landed for a while."""
    STATE = 9
    """P -> D: `state` (waiting, pushing, done, failed, unknown) and, when failed, `message`."""


@dataclass(frozen=True)
class HandshakeInfo:
    """What both sides must agree on for blocks to be copied byte for byte."""

    model: str
    dtype: str
    block_size: int
    kv_layout: str
    """Per-block tensor shape and device kind, e.g. "cpu:(2, 32, 64)" (CPU blocks are ISA-packed)."""
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_nbytes: int
    tp_size: int = 1
    tp_rank: int = 0
    """Tensor-parallel rank r holds KV-head slice r: it may only exchange blocks with rank r."""
    kv_groups: str = ""
    """The KV cache group of each layer, "1,0,1,0" (vLLM's hybrid allocator), or "" for one group: a
    block id means one group's block, so both sides must group the layers alike."""


# Compared in this order; the first difference names the error.
HANDSHAKE_FIELDS = ("protocol_version", "auth", *(f.name for f in fields(HandshakeInfo)))


def auth_proof(token: str, transfer_id: str) -> str:
    """Per-transfer proof of the shared token (the token itself never crosses the wire)."""
    return hmac.new(token.encode(), b"disagg-kv|" + transfer_id.encode(), hashlib.sha256).hexdigest()


def check_compatible(
    local: HandshakeInfo, remote: dict[str, Any], token: str, transfer_id: str, peer: str
) -> None:
    """Raise `HandshakeMismatch` naming the first field where `remote` differs from `local`."""
    if remote.get("protocol_version") != PROTOCOL_VERSION:
        raise HandshakeMismatch("protocol_version", PROTOCOL_VERSION, remote.get("protocol_version"), peer)
    if not hmac.compare_digest(str(remote.get("auth", "")), auth_proof(token, transfer_id)):
        raise HandshakeMismatch("auth", "<shared token>", "<a different token>", peer)
    for name, value in asdict(local).items():
        if remote.get(name) != value:
            raise HandshakeMismatch(name, value, remote.get(name), peer)


@dataclass
class SideMsg:
    """One side-channel message. `body` holds `HandshakeInfo` fields plus per-type keys."""

    type: MsgType
    body: dict[str, Any]
    block_ids: tuple[int, ...] = ()
    trace: TraceContext | None = None
    """W3C trace context of the request (REGISTER only), filled and read by the tracer."""

    @property
    def transfer_id(self) -> str:
        return str(self.body.get("transfer_id", ""))


def handshake_body(info: HandshakeInfo, token: str, transfer_id: str) -> dict[str, Any]:
    return {
        "protocol_version": PROTOCOL_VERSION,
        "auth": auth_proof(token, transfer_id),
        "transfer_id": transfer_id,
        **asdict(info),
    }


class VersionMismatch(ProtocolError):
    """A side message from a peer of another protocol version (`peer_version`)."""

    def __init__(self, peer_version: int, peer: str):
        self.peer_version = peer_version
        super().__init__(
            f"side message from {peer}: protocol version {peer_version}, this side speaks {PROTOCOL_VERSION}; "
            "run the same vllm-disagg version on prefill and decode"
        )


def encode_msg(msg: SideMsg) -> bytes:
    body = json.dumps(msg.body, separators=(",", ":")).encode()
    if len(body) > MAX_BODY_BYTES or len(msg.block_ids) > MAX_BLOCK_IDS:
        raise ValueError(f"side message too large: body {len(body)} B, {len(msg.block_ids)} block ids")
    if msg.trace is not None and msg.type is not MsgType.REGISTER:
        raise ValueError(f"only REGISTER carries a trace context, not {msg.type.name}")
    trace = msg.trace.to_bytes() if msg.trace is not None else b""
    ids = np.asarray(msg.block_ids, dtype="<i4").tobytes()
    head = _HEADER.pack(_MAGIC, PROTOCOL_VERSION, int(msg.type), len(body), len(msg.block_ids), len(trace))
    return head + body + ids + trace


def cancel_msg(transfer_id: str, reason: str, relayed: bool = False, fenced: bool = False) -> bytes:
    """CANCEL of push `transfer_id` (sent by D's receiver, and by the router for a decode half it cut);
    `relayed`: passed on by rank 0 of a TP prefill instance, so not passed on again; `fenced`: D's receiver
    drops the push's later bytes itself, so P acknowledges at once instead of once its writes are out."""
    body: dict = {"transfer_id": transfer_id, "reason": reason[:200]}
    if relayed:
        body["relayed"] = True
    if fenced:
        body["fenced"] = True
    return encode_msg(SideMsg(MsgType.CANCEL, body))


def decode_msg(data: bytes | memoryview, peer: str = "?") -> SideMsg:
    """Parse and check one frame; `ProtocolError` says what was wrong (and the peer)."""
    data = bytes(data)
    if len(data) < _PREFIX.size:
        raise ProtocolError(f"side message from {peer}: {len(data)} bytes, shorter than the header")
    magic, version = _PREFIX.unpack_from(data)
    if magic != _MAGIC:
        raise ProtocolError(f"side message from {peer}: bad magic {magic!r}, expected {_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version, peer)
    if len(data) < _HEADER.size:
        raise ProtocolError(f"side message from {peer}: {len(data)} bytes, shorter than the header")
    _, _, mtype, body_len, num_ids, trace_len = _HEADER.unpack_from(data)
    if mtype not in MsgType._value2member_map_:
        raise ProtocolError(f"side message from {peer}: unknown type {mtype}")
    if body_len > MAX_BODY_BYTES or num_ids > MAX_BLOCK_IDS:
        raise ProtocolError(f"side message from {peer}: body {body_len} B / {num_ids} ids over limits")
    if trace_len not in (0, TRACE_CONTEXT_BYTES) or (trace_len and mtype != MsgType.REGISTER):
        raise ProtocolError(f"side message from {peer}: a {trace_len}-byte trace context on type {mtype}")
    expected = _HEADER.size + body_len + 4 * num_ids + trace_len
    if len(data) != expected:
        raise ProtocolError(f"side message from {peer}: {len(data)} bytes, header says {expected}")
    body = _parse_body(data[_HEADER.size : _HEADER.size + body_len], peer)
    ids = np.frombuffer(data, dtype="<i4", count=num_ids, offset=_HEADER.size + body_len)
    if num_ids and int(ids.min()) < 0:
        raise ProtocolError(f"side message from {peer}: negative block id")
    trace = TraceContext.from_bytes(data[expected - trace_len :], peer) if trace_len else None
    return SideMsg(MsgType(mtype), body, tuple(int(i) for i in ids), trace)


def legacy_reject(data: bytes | memoryview, err: VersionMismatch) -> bytes | None:
    """A REJECT an older peer can read (its own version's layout), naming both versions; None when
    that version's layout is unknown here (the peer then times out, and this side logged why)."""
    version = err.peer_version
    if version not in (1, 2, 3, 4):
        return None
    header = _HEADER_V1 if version == 1 else _HEADER  # 2's header is 3's to 5's: they added message types
    data = bytes(data)
    transfer_id = ""
    try:
        body_len = header.unpack_from(data)[3]
        transfer_id = str(json.loads(data[header.size : header.size + body_len]).get("transfer_id", ""))
    except (struct.error, ValueError, AttributeError, RecursionError):
        pass
    body = json.dumps({"transfer_id": transfer_id[:128], "field": "protocol_version", "message": str(err)}).encode()
    fields_ = (_MAGIC, version, int(MsgType.REJECT), len(body), 0) + ((0,) if version >= 2 else ())
    return header.pack(*fields_) + body


def _parse_body(raw: bytes, peer: str) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ProtocolError(f"side message from {peer}: body is not JSON ({err})") from None
    if not isinstance(body, dict) or not all(
        isinstance(v, (str, int, float, bool)) or v is None for v in body.values()
    ):
        raise ProtocolError(f"side message from {peer}: body must be a flat JSON object")
    if not isinstance(body.get("transfer_id", ""), str):
        raise ProtocolError(f"side message from {peer}: transfer_id must be a string")
    return body


def local_handshake_info(vllm_config: Any, layer_tensors: list[Any], layer_groups: tuple[int, ...] = ()) -> HandshakeInfo:
    """This worker's `HandshakeInfo`, from the engine config, its registered KV tensors and the KV
    cache group of each (`layer_specs.layer_groups`)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    first = layer_tensors[0]
    return HandshakeInfo(
        model=str(model_config.model),
        dtype=_kv_dtype(vllm_config),
        block_size=int(vllm_config.cache_config.block_size),
        kv_layout=f"{first.device.type}:{str(first.dtype).removeprefix('torch.')}{tuple(first.shape[1:])}",
        num_layers=len(layer_tensors),
        num_kv_heads=int(model_config.get_num_kv_heads(vllm_config.parallel_config)),
        head_size=int(model_config.get_head_size()),
        block_nbytes=int(first[0].numel() * first.element_size()),
        tp_size=tp_size,
        tp_rank=int(getattr(parallel, "rank", 0) or 0) % tp_size,
        kv_groups=encode_groups(layer_groups),
    )


def encode_groups(layer_groups: tuple[int, ...]) -> str:
    """`HandshakeInfo.kv_groups`: "" when every layer is in group 0."""
    return ",".join(map(str, layer_groups)) if any(layer_groups) else ""


def parse_groups(kv_groups: str, num_layers: int) -> tuple[int, ...]:
    """The group of each layer from `HandshakeInfo.kv_groups` (all 0 for "")."""
    return tuple(int(g) for g in kv_groups.split(",")) if kv_groups else (0,) * num_layers


def _kv_dtype(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")
