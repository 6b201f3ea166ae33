# SPDX-License-Identifier: Apache-2.0
"""Block-run planning shared by the one-sided backends (`rdma`, `mscclpp`): check one `BlockWrite`
against the destination region and turn its id lists into runs of consecutive blocks.

Pure python on purpose (no numpy/torch): the soft-RoCE VM runs it with Debian's python. The stream
backends have a numpy twin (`kv_common.joint_runs`) working on arrays they already hold.
"""

from __future__ import annotations

from typing import Any


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where source and destination ids are both consecutive: (src, dst, length)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def plan_block_write(
    write: Any, src_nbytes: int, src_num_blocks: int, dst_num_blocks: int, dst_block_nbytes: int
) -> list[tuple[int, int, int]]:
    """Runs (src block, dst block, count) of `write`; ValueError names any caller mistake."""
    name = write.region
    bs = src_nbytes // src_num_blocks
    if bs != dst_block_nbytes or src_nbytes % src_num_blocks:
        raise ValueError(f"region {name!r}: source block is {bs} bytes, peer's is {dst_block_nbytes}")
    src, dst = [int(i) for i in write.src_block_ids], [int(i) for i in write.dst_block_ids]
    if len(src) != len(dst):
        raise ValueError(f"region {name!r}: {len(src)} source ids but {len(dst)} destination ids")
    if src and (min(src) < 0 or max(src) >= src_num_blocks):
        raise ValueError(f"region {name!r}: source block id out of range 0..{src_num_blocks - 1}")
    if dst and (min(dst) < 0 or max(dst) >= dst_num_blocks):
        raise ValueError(f"region {name!r}: destination block id out of range 0..{dst_num_blocks - 1}")
    return block_runs(src, dst)
