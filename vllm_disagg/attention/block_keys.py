# SPDX-License-Identifier: Apache-2.0
"""Content keys of full KV blocks: what a restarted model worker asks the attention servers for.

`key_i = blake2b(key_{i-1} || salt || int32-LE token ids of block i, digest_size=16)`, with
`key_{-1}` = 16 zero bytes (`docs/design/retain_api.md`, "Keys"). Chaining makes a key name the whole
prefix, as vLLM's own prefix-cache hashes do: two requests share block i's key only if they share
every token up to the end of block i. The salt names the model and everything that changes its KV
(`model_salt`), so a server that kept another model's blocks never matches.

Only the connector computes keys; the servers treat them as opaque 16-byte names.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["KEY_SIZE", "ROOT_KEY", "chain_keys", "model_salt"]

KEY_SIZE = 16
ROOT_KEY = bytes(KEY_SIZE)


def chain_keys(token_ids: Sequence[int], block_size: int, salt: bytes, parent: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of the full blocks of `token_ids` (a trailing partial block gets none).

    `parent` continues a chain: `chain_keys(t[n*bs:], bs, salt, keys[n-1])` equals
    `chain_keys(t, bs, salt)[n:]`, so a request's keys can be extended block by block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if len(parent) != KEY_SIZE:
        raise ValueError(f"a parent key has {KEY_SIZE} bytes, got {len(parent)}")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    data = np.asarray(token_ids[: num_full * block_size], dtype="<i4").tobytes()
    step = block_size * 4
    keys, prev = [], parent
    for i in range(num_full):
        prev = hashlib.blake2b(prev + salt + data[i * step:(i + 1) * step], digest_size=KEY_SIZE).digest()
        keys.append(prev)
    return keys


def model_salt(vllm_config: Any) -> bytes:
    """A hash of what determines the KV of a token prefix: model, weights, dtype, block size, config.

    Two engines agree on it only if the same prefix gives them the same KV bytes in the same layout."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    hf = getattr(mc, "hf_config", None)
    factors = {
        "model": mc.model, "revision": mc.revision, "dtype": str(mc.dtype), "quantization": mc.quantization,
        "load_format": str(getattr(load, "load_format", "")), "hf_config": hf.to_json_string() if hf else "",
        "block_size": cc.block_size, "cache_dtype": str(cc.cache_dtype),
    }
    return hashlib.blake2b(json.dumps(factors, sort_keys=True, default=str).encode(), digest_size=16).digest()
