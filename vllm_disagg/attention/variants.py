# SPDX-License-Identifier: Apache-2.0
"""Attention variants: what one layer's attention is, beyond its shape, and the fail-closed check.

`LayerAttrs` is what travels in the session INIT for each layer (`wire.Geometry.layers`): sliding
window, soft-cap, ALiBi slopes, sinks, fp8 KV scales, and the window vLLM's CPU builder gives that
layer's KV group to the kernel's scheduler (part of the kernel's work split, so of its float
rounding). The server hands them to vLLM's own CPU kernel, so it computes exactly what a local
vLLM computes for that layer.

`collect_layer_attrs` reads them off the loaded model's vLLM `Attention` layers and refuses to
start on anything it does not know (an attribute vLLM added, a value that changes the math it does
not carry), naming it: remote attention never quietly computes something else.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from vllm_disagg.errors import ProtocolError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM CPU's; fp8 caches are uint8
SINK_DTYPES = ("float32", "bfloat16")  # what vLLM's CPU kernel runs sinks in


@dataclass(frozen=True)
class LayerAttrs:
    """One layer's attention variant; the defaults are plain causal attention."""

    sliding_window: int | None = None
    sched_window: int = -1  # the CPU scheduler metadata's window for this layer's KV group
    logits_soft_cap: float | None = None
    alibi_slopes: tuple[float, ...] | None = None  # one per query head (of the shard, on the wire)
    sinks: tuple[float, ...] | None = None  # one per query head (of the shard, on the wire)
    sinks_dtype: str | None = None
    k_scale: float = 1.0  # fp8 KV cache scales (layer._k_scale_float / _v_scale_float)
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1):
            raise ProtocolError(f"sliding_window must be a positive int or null, got {self.sliding_window!r}")
        if not _is_int(self.sched_window) or self.sched_window < -1 or self.sched_window == 0:
            raise ProtocolError(f"sched_window must be -1 or a positive int, got {self.sched_window!r}")
        if self.logits_soft_cap is not None and not (_finite(self.logits_soft_cap) and self.logits_soft_cap > 0):
            raise ProtocolError(f"logits_soft_cap must be a positive number or null, got {self.logits_soft_cap!r}")
        for name in ("alibi_slopes", "sinks"):
            values = getattr(self, name)
            if values is not None:
                if not isinstance(values, (list, tuple)) or not values or not all(_finite(v) for v in values):
                    raise ProtocolError(f"{name} must be a non-empty list of finite numbers or null")
                object.__setattr__(self, name, tuple(float(v) for v in values))
        if (self.sinks is None) != (self.sinks_dtype is None) or self.sinks_dtype not in (None, *SINK_DTYPES):
            raise ProtocolError(f"sinks_dtype {self.sinks_dtype!r} must be one of {SINK_DTYPES} exactly "
                                "when sinks are given")
        for name in ("k_scale", "v_scale"):
            if not (_finite(getattr(self, name)) and getattr(self, name) > 0):
                raise ProtocolError(f"{name} must be a positive number, got {getattr(self, name)!r}")

    @property
    def is_plain(self) -> bool:
        return self == LayerAttrs(sched_window=self.sched_window)

    def num_head_values(self) -> set[int]:
        return {len(v) for v in (self.alibi_slopes, self.sinks) if v is not None}

    def for_heads(self, heads: slice) -> LayerAttrs:
        """The attributes of a head shard: per-head values sliced to its query heads."""
        cut = {n: getattr(self, n)[heads] for n in ("alibi_slopes", "sinks") if getattr(self, n) is not None}
        return LayerAttrs(**{**asdict(self), **cut})

    @classmethod
    def from_dict(cls, raw: object) -> LayerAttrs:
        if not isinstance(raw, dict):
            raise ProtocolError(f"a layer's attributes must be a JSON object, got {type(raw).__name__}")
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:  # a newer model worker: refuse rather than ignore what it asks for
            raise ProtocolError(f"unknown layer attribute(s) {sorted(unknown)}: upgrade this attention server")
        return cls(**raw)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---- the model side: vLLM's Attention layers -> LayerAttrs, refusing the unknown -----------------

# Every public attribute of vLLM 0.32's `Attention` layer (`vars(layer)`), and what remote attention
# does with it. An attribute outside these sets is a vLLM change nobody checked: refuse.
_CARRIED = {"sliding_window", "kv_cache_dtype", "_k_scale_float", "_v_scale_float", "impl"}
_DEFAULTS = {  # values remote attention does not implement; anything else is refused
    "attn_type": "decoder", "kv_sharing_target_layer_name": None, "use_mm_prefix": False,
    "use_alibi_sqrt": False, "mm_prefix_clamp_sliding_window": False, "query_quant": None,
    "_o_scale_float": None,
}
_SHAPE = {"num_heads", "num_kv_heads", "head_size", "head_size_v"}  # equal to the model's, checked
_INERT = {  # do not change the math of a CPU attention layer (the CPU kernel does not read them)
    "training", "kv_cache_torch_dtype", "quant_config", "quant_method", "layer_name", "has_sink",
    "attn_backend", "backend", "dtype", "use_direct_call", "kv_cache", "isa", "_q_scale_float",
    "_prob_scale_float", "_k_scale_cpu", "_v_scale_cpu",
}
KNOWN_LAYER_ATTRIBUTES = frozenset(_CARRIED | set(_DEFAULTS) | _SHAPE | _INERT)
# what the remote impl accepts beyond AttentionImpl's positional arguments
KNOWN_IMPL_EXTRAS = frozenset({"sinks"})


class UnsupportedAttention(NotImplementedError):
    """A layer remote attention cannot compute exactly; the message names the layer and attribute."""


def check_block_size(backend_cls, block_size: int) -> None:
    """The engine's block is also the servers' kernel block, and a remote-attention worker runs without
    vLLM's hybrid manager, which can split a block for a local kernel (wiring.py): so the block size must
    be one the kernel takes (vLLM's CPU kernel: multiples of 32). Refused in one line, naming the flag."""
    if backend_cls.supports_block_size(block_size):
        return
    sizes = backend_cls.get_supported_kernel_block_sizes()
    raise UnsupportedAttention(f"remote attention cannot use --block-size {block_size}: the attention kernel takes "
                               f"{', '.join(map(str, sizes))}")


def check_impl_args(attn_type, kv_sharing_target_layer_name, kv_cache_dtype, extra: dict) -> None:
    """At model build: refuse what no server computes (the layer name is not known yet)."""
    unknown = sorted(set(extra) - KNOWN_IMPL_EXTRAS)
    if unknown:
        raise UnsupportedAttention(f"remote attention does not know the attention argument(s) {unknown} "
                                   "(a newer vLLM?); refusing rather than ignoring them")
    if str(getattr(attn_type, "value", attn_type)) != "decoder":
        raise UnsupportedAttention(f"remote attention runs decoder self-attention only, not attn_type="
                                   f"{getattr(attn_type, 'value', attn_type)!r} (encoder / cross attention)")
    if kv_sharing_target_layer_name is not None:
        raise UnsupportedAttention(
            f"remote attention does not support KV-sharing layers (this layer reads "
            f"{kv_sharing_target_layer_name}'s cache); run the model without remote attention")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedAttention(f"remote attention: kv_cache_dtype {kv_cache_dtype!r} is not one of "
                                   f"{KV_CACHE_DTYPES} (what vLLM's CPU attention kernel stores)")


def _module_internals() -> frozenset[str]:
    import torch

    return frozenset(vars(torch.nn.Module()))


def layer_attrs(layer, num_heads: int, num_kv_heads: int, head_size: int, sched_window: int) -> LayerAttrs:
    """One vLLM `Attention` layer (this rank's heads) as `LayerAttrs`; `UnsupportedAttention` names
    the first attribute it cannot carry."""
    name = getattr(layer, "layer_name", type(layer).__name__)
    internals = _module_internals()
    for attr, value in vars(layer).items():
        if attr in internals:
            continue
        if attr not in KNOWN_LAYER_ATTRIBUTES:
            raise UnsupportedAttention(
                f"{name}: remote attention does not know the attention layer attribute {attr!r} (= {value!r}); "
                "a newer vLLM added it, and computing without it could be wrong: refusing to start")
        if attr in _DEFAULTS and str(getattr(value, "value", value)) != str(_DEFAULTS[attr]):
            raise UnsupportedAttention(f"{name}: remote attention does not support {attr}={value!r}")
    shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": head_size, "head_size_v": head_size}
    for attr, want in shape.items():
        if getattr(layer, attr, want) != want:
            raise UnsupportedAttention(f"{name}: {attr}={getattr(layer, attr)} differs from the model's {want}; "
                                       "remote attention needs one head geometry for every layer")
    impl = layer.impl
    check_impl_args("decoder", getattr(impl, "kv_sharing_target_layer_name", None), layer.kv_cache_dtype, {})
    window = getattr(impl, "sliding_window", None)
    sinks = getattr(impl, "sinks", None)
    alibi = getattr(impl, "alibi_slopes", None)
    cap = getattr(impl, "logits_soft_cap", None)
    sinks_dtype = None
    if sinks is not None:
        sinks_dtype = "bfloat16" if str(sinks.dtype) == "torch.bfloat16" else "float32"  # as the CPU impl casts
    return LayerAttrs(
        sliding_window=None if window in (None, -1) else int(window), sched_window=int(sched_window),
        logits_soft_cap=float(cap) if cap else None,
        alibi_slopes=None if alibi is None else tuple(float(x) for x in alibi),
        sinks=None if sinks is None else tuple(float(x) for x in sinks.detach().float().cpu()),
        sinks_dtype=sinks_dtype, k_scale=float(layer._k_scale_float), v_scale=float(layer._v_scale_float),
    )


def collect_layer_attrs(vllm_config, specs: dict) -> list[LayerAttrs]:
    """Every decoder layer's `LayerAttrs`, in layer order, from the loaded model (this TP rank).
    `specs` is the runner's `get_kv_cache_spec()`: it decides the KV groups, hence each layer's
    scheduler window (as vLLM's CPU builder derives it: the group's common window, else -1)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.models.utils import extract_layer_index

    model_config, parallel_config = vllm_config.model_config, vllm_config.parallel_config
    by_index: dict[int, object] = {}
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        if not isinstance(layer, AttentionLayerBase):
            continue
        if not isinstance(layer, Attention):
            raise UnsupportedAttention(f"{name}: remote attention computes vLLM Attention layers only, not "
                                       f"{type(layer).__name__}")
        index = extract_layer_index(name)
        if index in by_index:
            raise UnsupportedAttention(f"{name}: a second attention layer in decoder layer {index}")
        by_index[index] = layer
    num_layers = model_config.get_num_layers(parallel_config)
    if sorted(by_index) != list(range(num_layers)):
        raise UnsupportedAttention(f"remote attention needs one attention layer per decoder layer (0..{num_layers - 1}); "
                                   f"the model has them at {sorted(by_index)}")
    windows = {ly.layer_name: _impl_window(ly) for ly in by_index.values()}
    sched = sched_windows(vllm_config, specs, windows)
    heads = model_config.get_num_attention_heads(parallel_config)
    kv_heads, head_size = model_config.get_num_kv_heads(parallel_config), model_config.get_head_size()
    return [layer_attrs(by_index[i], heads, kv_heads, head_size, sched.get(by_index[i].layer_name, -1))
            for i in range(num_layers)]


def _impl_window(layer) -> int:
    window = getattr(layer.impl, "sliding_window", None)
    return -1 if window is None else int(window)


def kv_groups(vllm_config, specs: dict) -> list:
    """vLLM's own KV cache groups for these layer specs (what the engine core will use)."""
    import copy

    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

    return get_kv_cache_groups(vllm_config, copy.deepcopy(specs))


def sched_windows(vllm_config, specs: dict, windows: dict[str, int]) -> dict[str, int]:
    """Layer name -> the window vLLM's CPU builder passes to the scheduler metadata of its group."""
    out: dict[str, int] = {}
    for group in kv_groups(vllm_config, specs):
        common = {windows.get(n, -1) for n in group.layer_names}
        window = common.pop() if len(common) == 1 else -1
        out.update(dict.fromkeys(group.layer_names, window))
    return out


def pool_bytes_per_block(vllm_config, specs: dict) -> int:
    """Bytes one block id costs in vLLM's KV pool: the largest group's sum of page sizes (a hybrid
    model's groups share block ids, so this is not the sum over all layers)."""
    return max(sum(specs[n].page_size_bytes for n in g.layer_names) for g in kv_groups(vllm_config, specs))


def allocate_windows_in_full(specs: dict) -> dict:
    """vLLM recycles a running request's out-of-window blocks, which the recovery's whole-sequence
    rebuild and request-wise placement (keyed on a request's first block) cannot follow. So
    windowed layers get full allocation on a remote-attention worker, as vLLM
    itself gives a hybrid model with its hybrid manager off: `FullAttentionSpec` keeps the window,
    the kernel still computes it, only the out-of-window blocks stay held (memory, not math)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, replace_as

    return {name: replace_as(spec, FullAttentionSpec, drop=("extra_retained_tokens",))
            if type(spec) is SlidingWindowSpec else spec for name, spec in specs.items()}


def check_request_wise_groups(vllm_config, specs: dict) -> None:
    """Request-wise placement keys a request on the first block of its row. vLLM frees a
    sliding-window group's out-of-window blocks while the request runs (another request may get
    them as its first block), so such a group cannot be placed request-wise. The remote-attention
    runner allocates windows in full (`allocate_windows_in_full`) before this runs: it is the guard
    that a window group never reaches request-wise placement some other way."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    for group in kv_groups(vllm_config, specs):
        if isinstance(group.kv_cache_spec, SlidingWindowSpec):
            raise UnsupportedAttention(
                f"request-wise remote attention cannot place sliding-window KV groups ({group.layer_names[0]}, "
                f"window {group.kv_cache_spec.sliding_window}): vLLM recycles a running request's "
                "out-of-window blocks, and placement keys on a request's first block (the remote-attention runner "
                "allocates windows in full: this spec did not come through it); use partition='head'")
