# SPDX-License-Identifier: Apache-2.0
"""How `vllm-disagg up --attention K` sizes its attention servers and picks their partition.

The model worker holds no KV: its scheduler's block count is the smallest server's. So each server
must hold at least one request of the longest length vLLM will admit, or vLLM refuses to start with
a message about `gpu_memory_utilization`. The size follows from the model (layers, KV heads, head
size), the max length, the dtype and the partition (head-wise a server holds its share of the KV
heads; request-wise every server holds the whole block space, see attention/partition.py). Without
`--attention-kv-cache-gib`, each server gets the decode instance's `--kv-cache-gib` share (its whole
budget request-wise, 1/K of it head-wise), never less than that floor, within the memory available.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.config import resolve_partition
from vllm_disagg.models import hf_text_config

CPU_BLOCK_SIZE = 128
"""vLLM's default KV block size on CPU."""
MEMORY_SHARE = 0.6
"""Share of the host's available memory the attention servers may take together (the model worker,
its engine and the OS need the rest)."""
GIB = 1 << 30


class SizingError(ValueError):
    """The attention servers cannot hold the KV the model worker needs; the message names the flags."""


@dataclass(frozen=True)
class ModelKV:
    """What one token's KV costs, from the model's config.json and the vLLM flags given to `up`."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    max_model_len: int
    dtype_bytes: int
    block_size: int = CPU_BLOCK_SIZE

    def bytes_for(self, num_tokens: int, num_kv_heads: int) -> int:
        """Bytes of whole blocks holding `num_tokens` tokens, for `num_kv_heads` heads of every layer."""
        blocks = math.ceil(num_tokens / self.block_size)
        return blocks * self.block_size * self.num_layers * num_kv_heads * 2 * self.head_size * self.dtype_bytes


def _vllm_flags(vllm_args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--max-model-len", type=str, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=None)
    return p.parse_known_args(list(vllm_args))[0]


def _max_len(text: str | None, config: dict) -> int:
    native = int(config.get("max_position_embeddings") or config.get("max_sequence_length") or 2048)
    if text is None or text in ("-1", "auto"):
        return native
    scale = {"k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def _text_config(model_dir: str) -> dict:
    config = hf_text_config(model_dir)
    missing = [k for k in ("num_attention_heads", "num_hidden_layers") if k not in config]
    if missing:
        raise SizingError(f"cannot size the attention servers: {model_dir}/config.json has no "
                          f"{', '.join(missing)} (model_type {config.get('model_type')!r})")
    return config


def model_kv(model_dir: str, vllm_args: list[str]) -> ModelKV:
    """The KV geometry of `model_dir` as vLLM will serve it with `vllm_args`."""
    config = _text_config(model_dir)
    flags = _vllm_flags(vllm_args)
    heads = int(config["num_attention_heads"])
    head_size = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    dtype = flags.dtype if flags.dtype != "auto" else str(config.get("dtype") or config.get("torch_dtype") or "")
    return ModelKV(num_layers=int(config["num_hidden_layers"]),
                   num_kv_heads=int(config.get("num_key_value_heads") or heads), head_size=head_size,
                   max_model_len=_max_len(flags.max_model_len, config),
                   dtype_bytes=4 if dtype in ("float32", "float", "fp32") else 2,
                   block_size=flags.block_size or CPU_BLOCK_SIZE)


def available_bytes() -> int:
    """MemAvailable of this host (the servers do not use vLLM's NUMA memory binding)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class AttentionSizing:
    partition: str
    """"head" or "request" ("auto" resolved for this model)."""
    kv_cache_gib: float
    """KV memory of each server."""
    needed_gib: float
    """The least each server must hold: one request of max_model_len tokens."""


def size_attention(kv: ModelKV, num_servers: int, partition: str, kv_cache_gib: float | None,
                   instance_kv_gib: float, available: int | None = None) -> AttentionSizing:
    """Partition and per-server KV size; `kv_cache_gib` None sizes it here (module docstring)."""
    part = resolve_partition(partition, num_servers, kv.num_kv_heads)
    if part == "head" and kv.num_kv_heads % num_servers:
        raise SizingError(f"--attention-partition head needs --attention {num_servers} to divide the model's "
                          f"{kv.num_kv_heads} KV heads; use --attention-partition request (or auto)")
    heads = kv.num_kv_heads // num_servers if part == "head" else kv.num_kv_heads
    needed = kv.bytes_for(kv.max_model_len, heads) / GIB
    fix = (f"pass --max-model-len N (at most {_fitting_len(kv, heads, kv_cache_gib)} fits) or a larger "
           "--attention-kv-cache-gib")
    if kv_cache_gib is not None:
        if kv_cache_gib < needed:
            raise SizingError(f"--attention-kv-cache-gib {kv_cache_gib:g} holds no request of --max-model-len "
                              f"{kv.max_model_len} ({needed:.3f} GiB per server, {part}-wise, "
                              f"{kv.dtype_bytes * 8}-bit KV): {fix}")
        return AttentionSizing(part, kv_cache_gib, needed)
    cap = (available_bytes() if available is None else available) * MEMORY_SHARE / num_servers / GIB
    share = instance_kv_gib / num_servers if part == "head" else instance_kv_gib
    size = round(max(share, needed * 1.01), 3)
    if size > cap:
        if needed > cap:
            raise SizingError(f"the attention servers cannot hold one request of --max-model-len "
                              f"{kv.max_model_len} ({needed:.3f} GiB per server, {part}-wise) in the memory "
                              f"available ({cap:.3f} GiB per server): pass --max-model-len N (at most "
                              f"{_fitting_len(kv, heads, cap)} fits) or a smaller --attention-kv-cache-gib "
                              "with more memory free")
        size = round(cap, 3)
    return AttentionSizing(part, size, needed)


def _fitting_len(kv: ModelKV, heads: int, gib: float | None) -> int:
    if gib is None:
        return kv.max_model_len
    per_block = kv.bytes_for(kv.block_size, heads)
    return int(gib * GIB // per_block) * kv.block_size


def size_for_args(args: argparse.Namespace, model_dir: str) -> AttentionSizing:
    """`size_attention` for `up`'s flags and the vLLM arguments it passes on (local and Ray backends)."""
    kv = model_kv(model_dir, list(getattr(args, "vllm_args", [])))
    return size_attention(kv, args.attention, args.attention_partition, args.attention_kv_cache_gib,
                          args.kv_cache_gib)
