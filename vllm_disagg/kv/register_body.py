# SPDX-License-Identifier: Apache-2.0
"""REGISTER's body fields beyond the handshake, both directions: where the pushed blocks go
(`targets`, head-wise attention servers) and which blocks of each KV cache group D registered
(`more_groups`). Side-channel bodies are flat JSON, so lists travel as short strings."""

from __future__ import annotations


def parse_targets(body: dict, num_kv_heads: int) -> tuple[tuple[str, int, int], ...]:
    """The registration's write targets (default: the decode worker's own receiver), checked.

    Side-channel bodies are flat, so `targets` is "ADDR,NUM_SHARDS,SHARD;ADDR,NUM_SHARDS,SHARD;..."."""
    raw = body.get("targets")
    if raw is None:
        return ((str(body["address"]), 1, 0),)
    items = raw.split(";") if isinstance(raw, str) else []
    if not 1 <= len(items) <= 64:
        raise ValueError(f"targets: expected 1..64 'ADDR,NUM_SHARDS,SHARD' separated by ';', got {raw!r}"[:200])
    out = []
    for item in items:
        address, num_shards, shard = item.rsplit(",", 2)  # ValueError when malformed: REJECT
        num_shards, shard = int(num_shards), int(shard)
        if not address or num_shards < 1 or num_kv_heads % num_shards or not 0 <= shard < num_shards:
            raise ValueError(f"target {address!r}: shard {shard} of {num_shards} does not split "
                             f"{num_kv_heads} KV heads")
        out.append((address, num_shards, shard))
    return tuple(out)


def parse_registered_blocks(body: dict, block_ids: tuple[int, ...], num_groups: int) -> tuple:
    """(group 0's block ids, its start block, more_groups) of a REGISTER: its ids are every KV cache
    group's, in group order; `more_groups` ("START:COUNT;...") sizes groups 1.. . ValueError when they
    do not add up to the frame's ids or to this side's number of groups."""
    raw = body.get("more_groups") or ""
    sizes = [item.split(":") for item in raw.split(";")] if raw else []
    if len(sizes) != num_groups - 1:
        raise ValueError(f"REGISTER has {len(sizes) + 1} KV cache group(s), this side {num_groups}")
    more = [(int(start), int(count)) for start, count in sizes]
    num_first = len(block_ids) - sum(count for _, count in more)
    if num_first < 0 or any(start < 0 or count < 0 for start, count in more):
        raise ValueError(f"more_groups {raw!r} does not fit the {len(block_ids)} registered block ids"[:200])
    out, offset = [], num_first
    for start, count in more:
        out.append((start, tuple(block_ids[offset:offset + count])))
        offset += count
    return tuple(block_ids[:num_first]), int(body["start_block"]), tuple(out)


def encode_more_groups(more_groups: tuple[tuple[int, tuple[int, ...]], ...]) -> str:
    """`more_groups` for a REGISTER body (the decode side of `parse_registered_blocks`)."""
    return ";".join(f"{start}:{len(ids)}" for start, ids in more_groups)


def encode_targets(targets: list[tuple[str, int, int]]) -> str:
    """`targets` for a REGISTER body (the decode side of `parse_targets`)."""
    return ";".join(f"{address},{num_shards},{shard}" for address, num_shards, shard in targets)
