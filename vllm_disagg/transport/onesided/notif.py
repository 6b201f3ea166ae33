# SPDX-License-Identifier: Apache-2.0
"""The notification slot both one-sided backends (`rdma`, `mscclpp`) write after a KV write's data:
seq, layer, bytes and the transfer id, checked by the receiver before it is used. Pure python."""

from __future__ import annotations

import struct

from vllm_disagg.errors import ProtocolError

MAX_TID_BYTES = 128
# KV notification body: seq, layer, nbytes, tid_len; tid follows (<= MAX_TID_BYTES).
NOTIF_BODY = struct.Struct("<QiQH")
NOTIF_SLOT_BYTES = 256


def pack_notif(buf: memoryview, seq: int, layer: int, nbytes: int, transfer_id_bytes: bytes) -> None:
    NOTIF_BODY.pack_into(buf, 0, seq, layer, nbytes, len(transfer_id_bytes))
    buf[NOTIF_BODY.size : NOTIF_BODY.size + len(transfer_id_bytes)] = transfer_id_bytes


def parse_notif(body: memoryview, want_seq: int, peer: str) -> tuple[int, int, str]:
    """(layer, nbytes, transfer_id) of the notification in `body`, checked against `want_seq`."""
    seq, layer, nbytes, transfer_id_len = NOTIF_BODY.unpack_from(body)
    if seq != want_seq or transfer_id_len > MAX_TID_BYTES:
        raise ProtocolError(f"rdma notification from {peer}: seq {seq} (want {want_seq}), tid_len {transfer_id_len}")
    try:
        transfer_id = bytes(body[NOTIF_BODY.size : NOTIF_BODY.size + transfer_id_len]).decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"rdma notification from {peer}: transfer_id is not UTF-8") from None
    return layer, nbytes, transfer_id
