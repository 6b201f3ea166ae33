# SPDX-License-Identifier: Apache-2.0
"""Which blocks of an attention server's KV hold which token chain, and keeping them across a
model-worker restart (plain code: no vLLM, no wire).

A block key is 16 opaque bytes the model worker's connector computes from the token ids
(`block_keys.chain_keys`); the server only maps keys to blocks.

More: README.md, "retain.py".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

KEY_BYTES = 16


class BlockStore(Protocol):
    """The block-level data access `KVRetention` needs (implemented by the attention kernels)."""

    block_nbytes: int

    def save_block(self, block: int) -> torch.Tensor:
        """A copy of block `block`'s data, all layers of this shard."""

    def load_block(self, data: torch.Tensor, block: int) -> None:
        """Write `save_block`'s copy into block `block`."""

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Block `src[i]` -> block `dst[i]`, all layers (sources are never among the destinations)."""


@dataclass
class _Entry:
    block: int | None  # the block that holds the data, or None: the data is in `data`
    data: torch.Tensor | None
    expires: float


class KVRetention:
    """The registration index of the current session plus the retained set of earlier ones.

    `ttl_s <= 0` disables retention: registrations are ignored and nothing is retained."""

    def __init__(self, ttl_s: float = 600.0, max_copy_bytes: int = 1 << 30,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.max_copy_bytes = max_copy_bytes
        self._clock = clock
        self._lock = threading.RLock()
        self._index: dict[int, bytes] = {}  # block -> key (current session)
        self._retained: dict[bytes, _Entry] = {}  # key -> where its data is
        self._by_block: dict[int, bytes] = {}  # block -> retained key whose data it still holds
        self._copy_bytes = 0
        self._next_expiry = float("inf")
        self.num_dropped = 0  # retained entries lost to the copy budget (misses later, never wrong data)

    # ---- current session -------------------------------------------------------------------
    def register(self, block_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Block `block_ids[i]` holds the chain `keys[i]` (written by an earlier step)."""
        if self.ttl_s <= 0:
            return
        with self._lock:
            for b, k in zip(block_ids, keys):
                held = self._by_block.get(b)
                if held is not None and held != k:
                    continue  # b still holds retained data it was never rewritten over: keep that truth
                self._index[b] = k

    def needs_write_check(self) -> bool:
        """False when nothing is registered or retained: the step's writes need no look-up."""
        return bool(self._index or self._by_block)

    def before_write(self, block_ids: Iterable[int], blocks: BlockStore) -> None:
        """The session is about to write into `block_ids`: drop their registrations and move
        retained data out of them (copy-on-write)."""
        with self._lock:
            self._maybe_purge()
            for b in block_ids:
                self._index.pop(b, None)
                key = self._by_block.pop(b, None)
                if key is not None:
                    self._copy_out(key, b, blocks)

    def _copy_out(self, key: bytes, block: int, blocks: BlockStore) -> None:
        entry = self._retained[key]
        if self._copy_bytes + blocks.block_nbytes > self.max_copy_bytes:
            del self._retained[key]
            self.num_dropped += 1
            return
        entry.data, entry.block = blocks.save_block(block), None
        self._copy_bytes += blocks.block_nbytes

    # ---- session change --------------------------------------------------------------------
    def new_session(self) -> int:
        """A new client with the same geometry: the current registrations become retained.
        Returns the number of retained keys."""
        with self._lock:
            self._purge(self._clock())
            if self.ttl_s <= 0:
                self.reset()
                return 0
            expires = self._clock() + self.ttl_s
            fresh = {k: _Entry(b, None, expires) for b, k in self._index.items()}
            for k, e in self._retained.items():
                if k not in fresh and (e.block is None or e.block not in self._index):
                    fresh[k] = e
            self._index.clear()
            self._set_retained(fresh)
            return len(fresh)

    def reset(self) -> None:
        """The KV itself is gone (new geometry): forget everything."""
        with self._lock:
            self._index.clear()
            self._set_retained({})

    def _set_retained(self, entries: dict[bytes, _Entry]) -> None:
        self._retained = entries
        self._by_block = {e.block: k for k, e in entries.items() if e.block is not None}
        self._copy_bytes = sum(e.data.nbytes for e in entries.values() if e.data is not None)
        self._next_expiry = min((e.expires for e in entries.values()), default=float("inf"))

    def _maybe_purge(self) -> None:
        if self._retained:
            now = self._clock()
            if now >= self._next_expiry:
                self._purge(now)

    def _purge(self, now: float) -> None:
        if any(e.expires <= now for e in self._retained.values()):
            self._set_retained({k: e for k, e in self._retained.items() if e.expires > now})

    # ---- look-up and restore ---------------------------------------------------------------
    def keys(self) -> tuple[list[bytes], float]:
        """The retained keys and the seconds until the first of them expires (0 if none)."""
        with self._lock:
            now = self._clock()
            self._purge(now)
            return list(self._retained), max(0.0, self._next_expiry - now) if self._retained else 0.0

    def restore(self, block_ids: Sequence[int], keys: Sequence[bytes], blocks: BlockStore) -> list[int]:
        """Copy the data of `keys[i]` into block `block_ids[i]` (distinct) and register it there.
        Returns the block ids whose key is not retained (missing or expired)."""
        with self._lock:
            self._purge(self._clock())
            # a key restored into the block that already holds it needs no copy (nor copy-on-write)
            own = {b for b, k in zip(block_ids, keys) if self._by_block.get(b) == k}
            self.before_write([b for b in block_ids if b not in own], blocks)
            failed, src, dst, loads = [], [], [], []
            for b, k in zip(block_ids, keys):
                entry = self._retained.get(k)
                if entry is None:
                    failed.append(b)
                    continue
                if entry.block is None:
                    loads.append((entry.data, b))
                elif entry.block != b:
                    src.append(entry.block)
                    dst.append(b)
                self._index[b] = k
            if src:
                blocks.copy_blocks(src, dst)
            for data, b in loads:
                blocks.load_block(data, b)
            return failed

    # ---- introspection (metrics, tests) ------------------------------------------------------
    @property
    def num_retained(self) -> int:
        return len(self._retained)

    @property
    def num_registered(self) -> int:
        return len(self._index)

    @property
    def copy_bytes(self) -> int:
        return self._copy_bytes

    def registered(self) -> dict[int, bytes]:
        with self._lock:
            return dict(self._index)
