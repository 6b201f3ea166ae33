# SPDX-License-Identifier: Apache-2.0
"""What the KV push can ship: per-layer KV cache specs it knows, refused by name otherwise.

The push copies each layer's whole blocks byte for byte, addressed by the block table of that layer's
KV cache group. `DisaggConnector` supports vLLM's hybrid allocator (`SupportsHMA`): a hybrid model
(Gemma 2, GPT-OSS) gets one group per attention type, and its sliding-window group holds only the
blocks inside the window (vLLM gives the others its null block), so D registers, per group, from its
first block inside the window (`scheduler.recv_groups`) and P pushes each layer's blocks from its own
group. A model whose every layer is windowed (Mistral) has one sliding-window group. Both sides must
group the layers alike (`HandshakeInfo.kv_groups`), and every layer must have the same block shape
(the handshake compares one). Anything else (Mamba/MLA/cross-attention specs, a spec field a newer
vLLM added) refuses to start, naming it: the push never ships bytes it does not understand.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_disagg.config import DisaggConfigError

# vLLM 0.32's fields of the specs the push ships; a field outside these is a change nobody checked
_COMMON = {"block_size", "dcp_sharded", "block_stride_alignment", "max_tp_shards", "num_kv_heads", "head_size",
           "dtype", "head_size_v", "kv_quant_mode", "page_size_padded", "num_head_slots", "state_content_bytes",
           "tokens_per_state", "sliding_window"}
KNOWN_SPEC_FIELDS = {
    "FullAttentionSpec": frozenset(_COMMON | {"attention_chunk_size", "non_causal"}),
    "SlidingWindowSpec": frozenset(_COMMON | {"extra_retained_tokens"}),
}
# fields whose other values change what a block holds in ways the push was not checked against
_DEFAULTS = {"non_causal": False, "attention_chunk_size": None, "num_head_slots": None,
             "state_content_bytes": None}


def check_push_specs(kv_cache_config: Any) -> None:
    """Raise `DisaggConfigError` naming the first KV group, spec or field the push cannot ship."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    for group in groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        layer = group.layer_names[0] if group.layer_names else "?"
        if kind not in KNOWN_SPEC_FIELDS:
            raise DisaggConfigError(f"the KV push does not know KV cache spec {kind} ({layer}); refusing to ship "
                                    "its blocks")
        names = {f.name for f in dataclasses.fields(spec)}
        unknown = sorted(names - KNOWN_SPEC_FIELDS[kind])
        if unknown:
            raise DisaggConfigError(f"the KV push does not know {kind} field(s) {unknown} ({layer}); a newer vLLM "
                                    "added them, and shipping blocks without checking them could be wrong")
        for field, default in _DEFAULTS.items():
            if field in names and getattr(spec, field) != default:
                raise DisaggConfigError(f"the KV push does not support {kind}.{field}={getattr(spec, field)!r} "
                                        f"({layer})")
        if spec.head_size_v != spec.head_size:
            raise DisaggConfigError(f"the KV push needs K and V of one head size; {layer} has "
                                    f"{spec.head_size}/{spec.head_size_v}")


def check_uniform_layers(names: list[str], tensors: list[Any]) -> None:
    """Every layer's KV tensor has the first one's shape and dtype (the handshake compares that one)."""
    first = tensors[0]
    for name, t in zip(names, tensors):
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
            raise DisaggConfigError(f"the KV push needs one block layout for every layer: {name} is "
                                    f"{t.dtype}{tuple(t.shape[1:])}, {names[0]} {first.dtype}{tuple(first.shape[1:])}")


def layer_groups(names: list[str], kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache group of each layer in `names` (the push's layer order); all 0 without groups."""
    group_of = {name: g for g, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or [])
                for name in group.layer_names}
    return tuple(group_of.get(name, 0) for name in names)
