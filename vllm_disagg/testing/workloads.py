# SPDX-License-Identifier: Apache-2.0
"""Synthetic request sets for benchmarks, deterministic so paired runs see the same requests.

`long_context_requests` is Lamina's capacity workload (benchmarks/attn_bench.py): many requests
whose final context (prompt + output) is spread evenly over [min_context, max_context], each
decoding `output_len` tokens. Prompts are random token ids without a shared prefix, so prefix
caching saves nothing and every request holds its own KV: memory, not reuse, caps the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def context(self) -> int:
        """Tokens of KV the request holds once it has finished decoding."""
        return len(self.prompt_token_ids) + self.max_tokens


def context_lengths(num: int, min_context: int, max_context: int) -> list[int]:
    """`num` final contexts evenly spread over [min_context, max_context] (both ends included)."""
    if num < 1 or not 0 < min_context <= max_context:
        raise ValueError(f"need num >= 1 and 0 < min_context <= max_context, got {num}, {min_context}, {max_context}")
    if num == 1:
        return [max_context]
    step = (max_context - min_context) / (num - 1)
    return [min_context + round(i * step) for i in range(num)]


def long_context_requests(num: int, min_context: int, max_context: int, output_len: int, vocab: int,
                          seed: int = 0, first_token_id: int = 3) -> list[Request]:
    """Requests whose context (prompt + `output_len`) spans [min_context, max_context], in an order
    that interleaves short and long ones (so any prefix of the list has a similar mix); token ids are
    drawn from [first_token_id, vocab) by `random.Random(seed)`."""
    if output_len < 1 or output_len >= min_context:
        raise ValueError(f"output_len must be in [1, min_context), got {output_len} with min_context {min_context}")
    lengths = context_lengths(num, min_context, max_context)
    order = [lengths[i // 2] if i % 2 == 0 else lengths[num - 1 - i // 2] for i in range(num)]
    rng = random.Random(seed)
    return [Request([rng.randrange(first_token_id, vocab) for _ in range(ctx - output_len)], output_len)
            for ctx in order]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """KV cache bytes one token takes over all layers (K and V)."""
    return num_layers * num_kv_heads * head_size * 2 * dtype_bytes
