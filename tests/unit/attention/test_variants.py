# SPDX-License-Identifier: Apache-2.0
"""Attention variants on the server: each layer's window, soft-cap, ALiBi, sinks and fp8 KV cache
reach vLLM's CPU kernel (checked against a plain-torch reference), travel in the INIT, and whatever
remote attention or the push does not know refuses to start, naming it."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from vllm_disagg.attention.kernels import CpuAttentionKernel, kv_bytes_per_block
from vllm_disagg.attention.variants import (
    KNOWN_LAYER_ATTRIBUTES,
    LayerAttrs,
    UnsupportedAttention,
    allocate_windows_in_full,
    check_impl_args,
    check_request_wise_groups,
    layer_attrs,
)
from vllm_disagg.attention.wire import Geometry, StepMeta
from vllm_disagg.config import DisaggConfigError
from vllm_disagg.errors import ProtocolError

HQ, HKV, D, BS = 4, 2, 32, 32
FP8_ON_THIS_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
"""vLLM's CPU attention runs an fp8 KV cache only with AVX-512 or AMX (cpu_attn._get_attn_isa)."""
LENGTHS = [100, 70, 5]


def _geometry(layers=(), kv_cache_dtype="auto") -> Geometry:
    return Geometry(num_layers=2, num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS, dtype="float32",
                    max_num_tokens=512, kv_cache_dtype=kv_cache_dtype, layers=tuple(layers))


def _prefill(kern: CpuAttentionKernel, layer: int, seed: int = 0):
    """Prefill LENGTHS on `layer`; returns (q, k, v, out) with requests back to back."""
    gen = torch.Generator().manual_seed(seed)
    cols = -(-max(LENGTHS) // BS)
    table = torch.arange(1, 1 + len(LENGTHS) * cols, dtype=torch.int32).view(len(LENGTHS), cols)
    qsl = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.cat([table[r, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS
                       for r, n in enumerate(LENGTHS)])
    meta = StepMeta(qsl, torch.tensor(LENGTHS, dtype=torch.int32), table, slots)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    kern.write_kv(layer, k, v, meta)
    out = torch.empty(t, HQ, D)
    kern.attend(layer, q, meta, kern.prepare(meta, kern.sched_window(layer)), 0.3, out)
    return q, k, v, out


def _reference(q, k, v, a: LayerAttrs, scale=0.3):
    """The last token of each request, in plain torch, with the layer's variant."""
    outs, start = [], 0
    for n in LENGTHS:
        qi = q[start + n - 1].double()  # [H, D]
        ks, vs = k[start:start + n].double(), v[start:start + n].double()
        group = HQ // HKV
        logits = torch.einsum("hd,thd->ht", qi, ks.repeat_interleave(group, dim=1)) * scale
        if a.logits_soft_cap:
            logits = a.logits_soft_cap * torch.tanh(logits / a.logits_soft_cap)
        pos = torch.arange(n, dtype=torch.float64)
        if a.alibi_slopes is not None:
            logits = logits + torch.tensor(a.alibi_slopes, dtype=torch.float64)[:, None] * (pos - (n - 1))
        if a.sliding_window is not None:
            logits = logits.masked_fill(pos <= (n - 1) - a.sliding_window, float("-inf"))
        if a.sinks is not None:
            logits = torch.cat([logits, torch.tensor(a.sinks, dtype=torch.float64)[:, None]], dim=1)
            vs = torch.cat([vs, torch.zeros(1, HKV, D, dtype=torch.float64)])
        probs = torch.softmax(logits, dim=-1)
        outs.append(torch.einsum("ht,thd->hd", probs, vs.repeat_interleave(group, dim=1)))
        start += n
    return torch.stack(outs).float()


def _last_tokens(out):
    idx = torch.tensor(LENGTHS).cumsum(0) - 1
    return out[idx]


VARIANTS = {
    "window": LayerAttrs(sliding_window=40, sched_window=40),
    "window, group scheduled without it": LayerAttrs(sliding_window=40, sched_window=-1),
    "soft-cap": LayerAttrs(logits_soft_cap=1.5),
    "alibi": LayerAttrs(alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    "sinks": LayerAttrs(sinks=(1.0, -0.5, 2.0, 0.0), sinks_dtype="float32"),
    "all at once": LayerAttrs(sliding_window=40, sched_window=40, logits_soft_cap=1.5,
                              alibi_slopes=(0.5, 0.25, 0.125, 0.0625), sinks=(1.0, -0.5, 2.0, 0.0),
                              sinks_dtype="float32"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_reaches_vllms_cpu_kernel_on_its_own_layer(name):
    attrs = VARIANTS[name]
    kern = CpuAttentionKernel(_geometry([attrs, LayerAttrs()]), num_blocks=16)
    assert not kern.supports_lse  # the torch LSE path is plain attention only: send-Q-early stays off
    q, k, v, out = _prefill(kern, 0)
    torch.testing.assert_close(_last_tokens(out), _reference(q, k, v, attrs), atol=2e-5, rtol=1e-4)
    plain = _reference(q, k, v, LayerAttrs())
    assert (_last_tokens(out) - plain).abs().max() > 1e-3, "the variant made no difference"
    _, _, _, out1 = _prefill(kern, 1)  # layer 1 of the same kernel stays plain
    torch.testing.assert_close(_last_tokens(out1), plain, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_stores_bytes_and_stays_close_to_full_precision(kv_cache_dtype):
    g = _geometry(kv_cache_dtype=kv_cache_dtype)
    if not FP8_ON_THIS_CPU:  # the server's INIT fails with vLLM's own line, which names the reason
        with pytest.raises(NotImplementedError, match="AVX-512 or AMX"):
            CpuAttentionKernel(g, num_blocks=16)
        pytest.skip("this CPU has neither AVX-512 nor AMX: vLLM's CPU kernel refuses an fp8 KV cache (checked)")
    kern = CpuAttentionKernel(g, num_blocks=16)
    assert kern.caches[0].dtype == torch.uint8
    assert kv_bytes_per_block(g) * 4 == kv_bytes_per_block(_geometry())
    q, k, v, out = _prefill(kern, 0)
    err = (_last_tokens(out) - _reference(q, k, v, LayerAttrs())).abs().mean()
    assert 0 < err < (0.1 if kv_cache_dtype == "fp8_e5m2" else 0.05)  # 2 or 3 mantissa bits


def test_layer_attributes_round_trip_the_init_and_head_shards_get_their_heads():
    g = _geometry([VARIANTS["all at once"], LayerAttrs()], kv_cache_dtype="fp8")
    assert Geometry.from_json(g.to_json()) == g
    shard = VARIANTS["all at once"].for_heads(slice(2, 4))
    assert shard.alibi_slopes == (0.125, 0.0625) and shard.sinks == (2.0, 0.0)
    assert b'"layers"' not in _geometry().to_json()  # a plain INIT is what it always was
    # GET /kv/retained reports the geometry as JSON: LayerAttrs included (a restarted worker's reuse reads it)
    assert Geometry(**json.loads(json.dumps(g.as_dict()))) == g


@pytest.mark.parametrize(("layers", "match"), [
    ([{"sliding_window": 4, "new_vllm_thing": 1}, {}], "unknown layer attribute.*new_vllm_thing"),
    ([{"sinks": [1.0, 2.0], "sinks_dtype": "float32"}, {}], "per-head attributes must have 4 values"),
    ([{"sinks": [1.0] * 4}, {}], "sinks_dtype"),
    ([{"logits_soft_cap": -1.0}, {}], "logits_soft_cap"),
    ([{}], "1 layer attribute sets for 2 layers"),
])
def test_a_bad_or_unknown_layer_attribute_in_an_init_is_refused_by_name(layers, match):
    import json

    raw = json.loads(_geometry().to_json())
    raw["layers"] = layers
    with pytest.raises(ProtocolError, match=match):
        Geometry.from_json(json.dumps(raw).encode())


def _layer(**over):
    impl = types.SimpleNamespace(sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None,
                                 kv_sharing_target_layer_name=None)
    attrs = dict(layer_name="model.layers.0.self_attn.attn", num_heads=HQ, num_kv_heads=HKV, head_size=D,
                 head_size_v=D, sliding_window=None, kv_cache_dtype="auto", impl=impl, attn_type="decoder",
                 kv_sharing_target_layer_name=None, use_mm_prefix=False, use_alibi_sqrt=False,
                 mm_prefix_clamp_sliding_window=False, query_quant=None, _o_scale_float=None,
                 _k_scale_float=1.0, _v_scale_float=1.0, has_sink=False)
    attrs.update(over)
    assert set(attrs) <= KNOWN_LAYER_ATTRIBUTES
    return types.SimpleNamespace(**attrs)


def test_a_loaded_layer_becomes_its_attributes():
    layer = _layer(_k_scale_float=0.5)
    layer.impl.sliding_window, layer.impl.logits_soft_cap = 48, 4.0
    layer.impl.sinks = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.bfloat16)
    a = layer_attrs(layer, HQ, HKV, D, sched_window=48)
    assert (a.sliding_window, a.sched_window, a.logits_soft_cap, a.k_scale) == (48, 48, 4.0, 0.5)
    assert a.sinks == (0.5, 1.0, 1.5, 2.0) and a.sinks_dtype == "bfloat16"


@pytest.mark.parametrize(("over", "match"), [
    ({"chunk_lookback": 4}, "does not know the attention layer attribute 'chunk_lookback'"),
    ({"use_mm_prefix": True}, "does not support use_mm_prefix=True"),
    ({"attn_type": "encoder_only"}, "does not support attn_type"),
    ({"head_size_v": 64}, "head_size_v=64 differs"),
    ({"num_kv_heads": 1}, "num_kv_heads=1 differs"),
])
def test_an_attribute_remote_attention_does_not_know_refuses_to_start_naming_it(over, match):
    layer = _layer()
    for k, v in over.items():
        setattr(layer, k, v)
    with pytest.raises(UnsupportedAttention, match=match):
        layer_attrs(layer, HQ, HKV, D, sched_window=-1)


@pytest.mark.parametrize(("args", "match"), [
    (("decoder", "model.layers.0.self_attn.attn", "auto", {}), "KV-sharing layers"),
    (("encoder_only", None, "auto", {}), "decoder self-attention only"),
    (("decoder", None, "auto", {"chunk_lookback": 4}), r"does not know the attention argument\(s\) \['chunk_lookback'\]"),
    (("decoder", None, "nvfp4", {}), "kv_cache_dtype 'nvfp4'"),
])
def test_what_no_server_computes_is_refused_when_the_model_is_built(args, match):
    with pytest.raises(UnsupportedAttention, match=match):
        check_impl_args(*args)


def test_the_push_ships_kv_groups_and_refuses_specs_and_fields_it_does_not_know():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from vllm_disagg.kv.layer_specs import check_push_specs, layer_groups

    full = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=48)

    def config(*groups):
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(groups)])

    check_push_specs(config(full))
    check_push_specs(config(window))
    check_push_specs(config(window, full))  # vLLM's hybrid allocator: one block table per group
    assert layer_groups(["model.layers.1.attn", "model.layers.0.attn"], config(window, full)) == (1, 0)
    with pytest.raises(DisaggConfigError, match="non_causal=True"):
        check_push_specs(config(FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D,
                                                  dtype=torch.float32, non_causal=True)))


def test_request_wise_placement_gets_windows_allocated_in_full_and_refuses_a_window_group():
    """Mistral (every layer windowed) keeps a sliding-window group even with vLLM's hybrid manager
    off; request-wise placement needs its first block held, so the runner promotes it as vLLM
    promotes a hybrid model's windows. The guard still refuses a window group that got past that."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    window = SlidingWindowSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32, sliding_window=48)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=True))
    specs = {"model.layers.0.attn": window, "model.layers.1.attn": window}
    with pytest.raises(UnsupportedAttention, match=r"sliding-window KV groups \(model.layers.0.attn, window 48\)"):
        check_request_wise_groups(config, specs)
    promoted = allocate_windows_in_full(specs)
    assert all(type(s) is FullAttentionSpec and s.sliding_window == 48 for s in promoted.values())
    assert promoted["model.layers.0.attn"].page_size_bytes == window.page_size_bytes
    check_request_wise_groups(config, promoted)
    assert allocate_windows_in_full({"model.layers.0.attn": full})["model.layers.0.attn"] is full


def test_sinks_math_matches_the_reference_definition():
    # the reference's sink is one extra logit per head with a zero value vector
    a = LayerAttrs(sinks=(math.log(3.0),) * HQ, sinks_dtype="float32")
    q = torch.zeros(sum(LENGTHS), HQ, D)
    k = torch.zeros(sum(LENGTHS), HKV, D)
    v = torch.ones(sum(LENGTHS), HKV, D)
    out = _reference(q, k, v, a)
    torch.testing.assert_close(out[0], torch.full((HQ, D), 100 / 103))  # 100 equal logits + e^log3 = 3


@pytest.mark.parametrize("over", [dict(layers=(LayerAttrs(sliding_window=8),) * 2), dict(kv_cache_dtype="fp8")])
def test_the_torch_kernel_refuses_what_it_does_not_compute(over):
    from vllm_disagg.attention.kernels import TorchPagedKernel

    with pytest.raises(NotImplementedError, match="plain attention only"):
        TorchPagedKernel(_geometry(**over), num_blocks=8, device="cpu")


def test_a_block_size_the_kernel_does_not_take_is_refused_in_one_line_naming_the_flag():
    """Gemma 2 at --block-size 16 (vLLM's CPU kernel takes multiples of 32) got past vLLM's own check on a
    remote-attention worker and failed in the KV grouping with a line that named neither."""
    from vllm.v1.attention.backend import AttentionBackend

    from vllm_disagg.attention.remote_impl import RemoteAttentionBackend
    from vllm_disagg.attention.variants import check_block_size

    for ok in (32, 64, 128):
        check_block_size(RemoteAttentionBackend, ok)
    with pytest.raises(UnsupportedAttention, match=r"--block-size 16: the attention kernel takes MultipleOf\(32\)"):
        check_block_size(RemoteAttentionBackend, 16)
    check_block_size(AttentionBackend, 16)  # a kernel that takes any block (vLLM's default: MultipleOf(1))
