# SPDX-License-Identifier: Apache-2.0
"""Compatibility handshake and side-channel messages of the KV push (decode <-> prefill).

Before any KV byte moves, the decode worker sends REGISTER (its `HandshakeInfo`, the transfer id,
its receiver address and block ids) to the prefill worker's side channel. The prefill side checks
every field, in `HANDSHAKE_FIELDS` order, and answers ACCEPT (with its own info, which the decode
side checks too) or REJECT naming the first field that differs. CANCEL asks the prefill side to
stop a push and answers CANCEL_ACK once none of its writes are still in flight.

Wire format (one transport message per frame, no pickle):
    header  = struct "!4sHHII": magic b"DGKV", PROTOCOL_VERSION, msg type, json length,
              number of block ids
    body    = UTF-8 JSON object (strings, ints, floats only)
    payload = block ids as little-endian int32, immediately after the body

PROTOCOL_VERSION history:
    1: initial (REGISTER / ACCEPT / REJECT / CANCEL / CANCEL_ACK).
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

__all__ = [
    "PROTOCOL_VERSION",
    "HANDSHAKE_FIELDS",
    "HandshakeInfo",
    "MsgType",
    "SideMsg",
    "auth_proof",
    "check_compatible",
    "decode_msg",
    "encode_msg",
    "handshake_body",
    "local_handshake_info",
]

PROTOCOL_VERSION = 1
_MAGIC = b"DGKV"
_HEADER = struct.Struct("!4sHHII")
MAX_BODY_BYTES = 8 << 10
MAX_BLOCK_IDS = 12 << 10  # the whole frame must fit a transport message header (64 KiB)


class MsgType(enum.IntEnum):
    REGISTER = 1
    ACCEPT = 2
    REJECT = 3
    CANCEL = 4
    CANCEL_ACK = 5


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


def encode_msg(msg: SideMsg) -> bytes:
    body = json.dumps(msg.body, separators=(",", ":")).encode()
    if len(body) > MAX_BODY_BYTES or len(msg.block_ids) > MAX_BLOCK_IDS:
        raise ValueError(f"side message too large: body {len(body)} B, {len(msg.block_ids)} block ids")
    ids = np.asarray(msg.block_ids, dtype="<i4").tobytes()
    return _HEADER.pack(_MAGIC, PROTOCOL_VERSION, int(msg.type), len(body), len(msg.block_ids)) + body + ids


def decode_msg(data: bytes | memoryview, peer: str = "?") -> SideMsg:
    """Parse and check one frame; `ProtocolError` says what was wrong (and the peer)."""
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise ProtocolError(f"side message from {peer}: {len(data)} bytes, shorter than the header")
    magic, version, mtype, body_len, num_ids = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ProtocolError(f"side message from {peer}: bad magic {magic!r}, expected {_MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"side message from {peer}: protocol version {version}, expected {PROTOCOL_VERSION}; "
            "run the same vllm-disagg version on prefill and decode"
        )
    if mtype not in MsgType._value2member_map_:
        raise ProtocolError(f"side message from {peer}: unknown type {mtype}")
    if body_len > MAX_BODY_BYTES or num_ids > MAX_BLOCK_IDS:
        raise ProtocolError(f"side message from {peer}: body {body_len} B / {num_ids} ids over limits")
    expected = _HEADER.size + body_len + 4 * num_ids
    if len(data) != expected:
        raise ProtocolError(f"side message from {peer}: {len(data)} bytes, header says {expected}")
    body = _parse_body(data[_HEADER.size : _HEADER.size + body_len], peer)
    ids = np.frombuffer(data, dtype="<i4", count=num_ids, offset=_HEADER.size + body_len)
    if num_ids and int(ids.min()) < 0:
        raise ProtocolError(f"side message from {peer}: negative block id")
    return SideMsg(MsgType(mtype), body, tuple(int(i) for i in ids))


def _parse_body(raw: bytes, peer: str) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProtocolError(f"side message from {peer}: body is not JSON ({err})") from None
    if not isinstance(body, dict) or not all(
        isinstance(v, (str, int, float, bool)) or v is None for v in body.values()
    ):
        raise ProtocolError(f"side message from {peer}: body must be a flat JSON object")
    if not isinstance(body.get("transfer_id", ""), str):
        raise ProtocolError(f"side message from {peer}: transfer_id must be a string")
    return body


def local_handshake_info(vllm_config: Any, layer_tensors: list[Any]) -> HandshakeInfo:
    """This worker's `HandshakeInfo`, from the engine config and its registered KV tensors."""
    model_config = vllm_config.model_config
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
    )


def _kv_dtype(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")
