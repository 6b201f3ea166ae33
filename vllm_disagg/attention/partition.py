# SPDX-License-Identifier: Apache-2.0
"""How one step's attention is split across N attention servers.

More: README.md, "partition.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_disagg.attention.wire import StepMeta
from vllm_disagg.config import resolve_partition


@dataclass(frozen=True)
class HeadShard:
    q_heads: slice
    kv_heads: slice

    @property
    def num_heads(self) -> int:
        return self.q_heads.stop - self.q_heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start


def head_shards(num_servers: int, num_heads: int, num_kv_heads: int) -> list[HeadShard]:
    """Contiguous KV-head slices with their GQA query groups."""
    if num_kv_heads % num_servers:
        raise ValueError(
            f"head-wise partitioning needs the number of attention servers ({num_servers}) to divide "
            f"the model's KV heads ({num_kv_heads}); use partition='request' or {num_kv_heads} servers"
        )
    group = num_heads // num_kv_heads
    per = num_kv_heads // num_servers
    return [HeadShard(slice(s * per * group, (s + 1) * per * group), slice(s * per, (s + 1) * per))
            for s in range(num_servers)]


def resolved_section(remote_attention, vllm_config):
    """`remote_attention` with "auto" replaced by the partition it means for this engine's model."""
    if remote_attention.partition != "auto":
        return remote_attention
    kv_heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    partition = resolve_partition("auto", len(remote_attention.servers), kv_heads)
    return remote_attention.model_copy(update={"partition": partition})


@dataclass
class RequestSplit:
    """The part of a step that goes to one server under request-wise partitioning."""

    server: int
    token_ids: torch.Tensor  # indices into the step's tokens (int64)
    meta: StepMeta


class RequestPlacer:
    """Keeps request -> server; places new requests by KV load.

    Load of a server = sum of the latest seq_len of the requests placed on it and seen in the
    last `recent_steps` steps (a finished request stops counting after that window).
    """

    def __init__(self, num_servers: int, recent_steps: int = 32):
        self.num_servers = num_servers
        self._where: dict[int, list[int]] = {}  # first block id -> [server, last step seen, seq_len]
        # first block id -> server, never aged out (at most one entry per block): the server holding a
        # chain that starts there, for requests that start on cached blocks (prefix caching)
        self._first_owner: dict[int, int] = {}
        self._step = 0
        self._recent = recent_steps
        self.num_prefix_affinity = 0
        """Requests placed on the server of the cached chain they start on (a diagnostic: two requests
        running on one chain at once count again at later steps, as the key cannot tell them apart)."""

    def load(self) -> list[int]:
        out = [0] * self.num_servers
        for server, seen, seq_len in self._where.values():
            if seen >= self._step - self._recent:
                out[server] += seq_len
        return out

    def place(self, first_block: int, seq_len: int) -> int:
        """Place a request before its first step (its KV is pushed by a prefill instance): least load."""
        load = self.load()
        server = min(range(self.num_servers), key=lambda s: (load[s], s))
        self._set(first_block, server, seq_len)
        return server

    def _set(self, first_block: int, server: int, seq_len: int) -> None:
        self._where[first_block] = [server, self._step, seq_len]
        self._first_owner[first_block] = server

    def server_of(self, first_block: int) -> int | None:
        """The server of the request (or cached chain) whose block table starts at `first_block`."""
        where = self._where.get(first_block)
        return where[0] if where is not None else self._first_owner.get(first_block)

    def split(self, meta: StepMeta) -> list[RequestSplit]:
        self._step += 1
        qsl = meta.query_start_loc.tolist()
        seq = meta.seq_lens.tolist()
        first = meta.block_table[:, 0].tolist() if meta.num_reqs else []
        owner = [-1] * meta.num_reqs
        for r in range(meta.num_reqs):  # continuing requests keep their server
            if qsl[r + 1] - qsl[r] < seq[r]:
                server = self.server_of(first[r])
                if server is None:
                    raise ValueError(f"request with first block {first[r]} continues but was never placed")
                prev = self._where.get(first[r])  # the same request ran in the previous step up to here
                if prev is None or prev[1] != self._step - 1 or prev[2] != seq[r] - (qsl[r + 1] - qsl[r]):
                    self.num_prefix_affinity += 1  # it starts on a cached chain: where that chain lives
                owner[r] = server
                self._set(first[r], server, seq[r])
        for r in range(meta.num_reqs):  # new (or restarted) requests go where the KV load is least
            if owner[r] < 0:
                load = self.load()
                owner[r] = min(range(self.num_servers), key=lambda s: (load[s], s))
                self._set(first[r], owner[r], seq[r])
        self._gc()
        return [self._sub(meta, s, [r for r in range(meta.num_reqs) if owner[r] == s], qsl)
                for s in range(self.num_servers)]

    def _gc(self) -> None:
        if len(self._where) > 4096:
            cutoff = self._step - 8 * self._recent
            self._where = {b: v for b, v in self._where.items() if v[1] >= cutoff}

    @staticmethod
    def _sub(meta: StepMeta, server: int, reqs: list[int], qsl: list[int]) -> RequestSplit:
        tokens = [t for r in reqs for t in range(qsl[r], qsl[r + 1])]
        token_ids = torch.tensor(tokens, dtype=torch.int64)
        lens = torch.tensor([qsl[r + 1] - qsl[r] for r in reqs], dtype=torch.int32)
        sub_qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
        if reqs:
            sub_qsl[1:] = lens.cumsum(0)
        idx = torch.tensor(reqs, dtype=torch.int64)
        sub = StepMeta(sub_qsl, meta.seq_lens[idx].contiguous(), meta.block_table[idx].contiguous(),
                       meta.slot_mapping[token_ids].contiguous())
        return RequestSplit(server, token_ids, sub)
