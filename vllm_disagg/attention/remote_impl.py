# SPDX-License-Identifier: Apache-2.0
"""The remote attention backend's vLLM classes: metadata builder, impl, and the CPU / CUDA backends.

`backend.py` selects them (`SelectedBackend`) only when remote attention is configured;
`runtime.py` holds the process-wide client they use. Importing this module imports vLLM's attention
internals.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from vllm_disagg.attention import runtime
from vllm_disagg.attention import spans as step_spans
from vllm_disagg.attention.client import ClientMeta
from vllm_disagg.attention.variants import check_impl_args
from vllm_disagg.attention.wire import StepMeta
from vllm_disagg.overlap import defer_wait, wait_network


class RemoteAttentionMetadataBuilder(AttentionMetadataBuilder[ClientMeta]):
    _cudagraph_support: ClassVar = AttentionCGSupport.NEVER  # an RPC cannot be graph-captured

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> ClientMeta:
        return build_client_meta(common_attn_metadata, self.block_size)


class RemoteAttentionImpl(AttentionImpl):
    # The nano-batch executor runs this layer's attention on its "net" unit thread, so while
    # one nano-batch waits here the other's dense ops run: n=2 ping-pong (overlap_api.md).
    nanoflow_network_bound = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra):
        # what no server computes is refused here; the rest is read off the loaded layer and
        # travels in the INIT (variants.collect_layer_attrs), unknown attributes refused there
        check_impl_args(attn_type, kv_sharing_target_layer_name, kv_cache_dtype, extra)
        self.alibi_slopes = alibi_slopes
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = extra.get("sinks")  # a parameter: its values are loaded after this
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self._layer_idx: int | None = None
        self.nanoflow_network_bound = runtime.network_bound()  # n=1 runs the same impl serially
        # the client of the worker building this model (set before load_model): keeps two
        # in-process engines (a benchmark's A/B pair) on their own clients
        self._client = runtime.current_client()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by remote attention")
        if attn_metadata is None:  # profiling / warm-up
            return output
        if self._layer_idx is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layer_idx = extract_layer_index(layer.layer_name)
        n = attn_metadata.num_actual_tokens
        client = self._client if self._client is not None else runtime.get_client()
        step_spans.begin_step(self._layer_idx, attn_metadata)
        pending = client.submit(self._layer_idx, query[:n], key[:n], value[:n], attn_metadata, self.scale)
        hook = runtime.overlap_hook()
        if hook is not None:
            hook(pending)
        # n=2 pipeline: sent from the dense unit right after KQV, waited on the "net" unit, so
        # the other nano-batch's request is already queued at the server (overlap.deferred_waits)
        wait = partial(_wait, pending, output[:n], self._layer_idx, client, attn_metadata)
        if not defer_wait(wait):
            # in a turn-taking step (models off the Llama op path) another nano-batch computes
            # while this one waits (nanoflow/pingpong.py)
            wait_network(wait)
        return output


def _wait(pending, output, layer: int, client, meta) -> None:
    """The layer's answer; a sampled step's span (attention/spans.py) ends with its last layer."""
    pending.wait(output)
    step_spans.end_step(layer, client.geometry_args["num_layers"], meta)


class RemoteAttentionBackend(CPUAttentionBackend):
    """CPU: keeps the name CPU_ATTN (vLLM maps get_name() onto its enum)."""

    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_impl_cls():
        return RemoteAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RemoteAttentionMetadataBuilder


class RemoteAttentionCudaBackend(AttentionBackend):
    """GPU: the CUSTOM backend. UNTESTED HERE (no GPU); same impl and builder as on CPU."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return RemoteAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RemoteAttentionMetadataBuilder


def build_client_meta(cm, block_size: int) -> ClientMeta:
    """CommonAttentionMetadata -> the CPU tensors the servers need (block table trimmed)."""
    r, n = cm.num_reqs, cm.num_actual_tokens
    seq_lens = cm.seq_lens[:r].to("cpu", torch.int32)
    cols = max(1, -(-int(seq_lens.max()) // block_size)) if r else 1
    step = StepMeta(
        cm.query_start_loc_cpu[: r + 1].to(torch.int32).contiguous(),
        seq_lens.contiguous(),
        cm.block_table_tensor[:r, :cols].to("cpu", torch.int32).contiguous(),
        cm.slot_mapping[:n].to("cpu", torch.int64).contiguous(),
    )
    return ClientMeta(step, max_query_len=int(cm.max_query_len), num_actual_tokens=n)
