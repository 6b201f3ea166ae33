# SPDX-License-Identifier: Apache-2.0
"""End-to-end checksums of a KV push (opt-in: `kv.verify_checksums`), the check no transport makes.

Every backend checks its frames, but none checks the bytes that end up in D's blocks against the
bytes P's blocks held: a bit flipped by a NIC, a proxy, a DMA engine or a bug in a block mapping
would decode wrong tokens with HTTP 200. With the option on, D asks P (VERIFY) for one CRC32 per
layer once every byte has landed, computes the same over its own blocks, and recomputes the prompt
on any difference. A layer's CRC chains the CRC32s of its blocks in D's block order, so both sides
compute it from the final block contents, whatever order and batching the writes had.

Cost: one pass over the pushed KV on each side (about 1 GB/s on one CPU core), and one side-channel
round trip before D's first step. GPU blocks are copied to host for it, so on GPU the option is a
diagnostic, not a default.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

from vllm_disagg.transport.wire import as_byte_view

MAX_LAYERS = 512
"""A CHECKSUMS reply carries at most this many layers times shards (its body must fit the side
message's 8 KiB)."""


def layer_checksums(layers: Sequence[Any], block_ids: Sequence[int] | Sequence[Sequence[int]], num_shards: int = 1,
                    shard: int = 0) -> list[int]:
    """One CRC32 per layer over `block_ids` of that layer's KV tensor, in that order; a list of lists
    gives each layer its own ids (KV cache groups). With `num_shards` > 1, over KV-head slice `shard`
    of each block (the contiguous sub-block a head-wise attention server holds as its whole block:
    kv/push_plan.py's `shard_writes`)."""
    per_layer = len(block_ids) > 0 and isinstance(block_ids[0], (list, tuple))
    out = []
    for i, tensor in enumerate(layers):
        ids = block_ids[i] if per_layer else block_ids
        if num_shards > 1:
            ids = [b * num_shards + shard for b in ids]
            tensor = tensor.view(tensor.shape[0] * num_shards, -1)
        per_block = b"".join(struct.pack("<I", zlib.crc32(_bytes(tensor[b]))) for b in ids)
        out.append(zlib.crc32(per_block))
    return out


def encode_shards(per_shard: Sequence[Sequence[int]]) -> str:
    """A CHECKSUMS body's `crc32`: each shard's layers, `;` between (one shard: `encode`'s text)."""
    return ";".join(encode(checksums) for checksums in per_shard)


def decode_shards(text: object, num_layers: int, num_shards: int) -> list[list[int]]:
    """The per-shard CRCs of an `encode_shards` text; ValueError unless `num_shards` of `num_layers`."""
    parts = str(text).split(";") if text else []
    if len(parts) != num_shards:
        raise ValueError(f"expected checksums of {num_shards} shards, got {len(parts)}")
    return [decode(part, num_layers) for part in parts]


def encode(checksums: Sequence[int]) -> str:
    return ",".join(f"{c:08x}" for c in checksums)


def decode(text: object, num_layers: int) -> list[int]:
    """The CRCs of a CHECKSUMS body; ValueError if it is not `num_layers` 8-digit hex numbers."""
    parts = str(text).split(",") if text else []
    if len(parts) != num_layers or any(len(p) != 8 for p in parts):
        raise ValueError(f"expected {num_layers} checksums, got {str(text)[:80]!r}")
    return [int(p, 16) for p in parts]


def first_difference(local: Sequence[int], remote: Sequence[int]) -> int | None:
    """The first layer whose checksums differ, or None."""
    return next((i for i, (a, b) in enumerate(zip(local, remote, strict=True)) if a != b), None)


def _bytes(block: Any) -> memoryview:
    if getattr(block, "is_cpu", True) is False:
        block = block.cpu()
    return as_byte_view(block.contiguous() if hasattr(block, "contiguous") else block)
