# SPDX-License-Identifier: Apache-2.0
"""The remote attention backend: vLLM's attention layer, with the math done on attention servers.

Registered as the override of `CPU_ATTN` (CPU ignores `--attention-backend`) and of `CUSTOM`
(GPU, `--attention-backend CUSTOM`). The override path is `SelectedBackend`, resolved lazily by
the module `__getattr__` at model-build time: it is the stock `CPUAttentionBackend` unless
`additional_config["disagg"]["remote_attention"]` is set, so the override is inert otherwise.

`forward_includes_kv_cache_update = True`: vLLM skips its local cache write; the server writes
k/v with the scheduler's slot_mapping. The builder turns `CommonAttentionMetadata` into a small
CPU `ClientMeta` (one per step, shared by all layers); the impl hands each layer's q/k/v to the
process-wide `DisaggAttentionClient` that the worker (`worker.py`) installed.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch

from vllm_disagg.attention.client import ClientMeta, DisaggAttentionClient
from vllm_disagg.attention.wire import StepMeta
from vllm_disagg.overlap import defer_wait

_CLIENT: DisaggAttentionClient | None = None
_OVERLAP_HOOK = None  # callable(pending) -> None, set by the pipelining runtime (pipeline.py)
_NETWORK_BOUND = True  # what impls built from now on declare (set_network_bound)


def set_client(client: DisaggAttentionClient | None) -> None:
    global _CLIENT
    _CLIENT = client


def current_client() -> DisaggAttentionClient | None:
    """This process's attention client (installed by the remote-attention worker), or None."""
    return _CLIENT


def get_client() -> DisaggAttentionClient:
    if _CLIENT is None:
        raise RuntimeError(
            "remote attention is configured but this process has no attention client; run the engine "
            "with worker_cls='vllm_disagg.attention.worker.DisaggAttentionWorker'"
        )
    return _CLIENT


def set_overlap_hook(hook) -> None:
    """Install `hook(pending)`, called between submit and wait (the pipelining runtime's yield)."""
    global _OVERLAP_HOOK
    _OVERLAP_HOOK = hook


def set_network_bound(bound: bool) -> None:
    """Whether impls built from now on declare themselves network-bound (read once per impl): the
    nano-batch executor then runs their attention on its "net" unit (n=2 ping-pong), or not (n=1)."""
    global _NETWORK_BOUND
    _NETWORK_BOUND = bound


def remote_attention_enabled(vllm_config) -> bool:
    from vllm_disagg.config import disagg_config_from_vllm

    if vllm_config is None:
        return False
    cfg = disagg_config_from_vllm(vllm_config)
    return bool(cfg and cfg.remote_attention and cfg.remote_attention.servers)


def __getattr__(name: str):
    if name == "SelectedBackend":
        from vllm.config import get_current_vllm_config_or_none
        from vllm.platforms import current_platform

        if remote_attention_enabled(get_current_vllm_config_or_none()):
            return _cuda_or_cpu_remote()
        if not current_platform.is_cpu():
            raise ValueError("the CUSTOM attention backend is vllm-disagg's remote attention: set "
                             'additional_config["disagg"]["remote_attention"]["servers"]')
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name in ("RemoteAttentionBackend", "RemoteAttentionCudaBackend", "RemoteAttentionImpl",
                "RemoteAttentionMetadataBuilder"):
        return _classes()[name]
    raise AttributeError(name)


def _cuda_or_cpu_remote():
    from vllm.platforms import current_platform

    return _classes()["RemoteAttentionBackend" if current_platform.is_cpu() else "RemoteAttentionCudaBackend"]


_CLASSES: dict = {}


def _classes() -> dict:
    """Build the vLLM subclasses on first use, so importing this module needs no vLLM internals."""
    if _CLASSES:
        return _CLASSES
    from vllm.v1.attention.backend import (
        AttentionBackend,
        AttentionCGSupport,
        AttentionImpl,
        AttentionMetadataBuilder,
        AttentionType,
    )
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

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
            unsupported = {
                "alibi_slopes": alibi_slopes is not None, "sliding_window": sliding_window is not None,
                "logits_soft_cap": bool(logits_soft_cap), "attn_type": attn_type != AttentionType.DECODER,
                "kv_sharing": kv_sharing_target_layer_name is not None,
                "kv_cache_dtype": kv_cache_dtype not in ("auto", None), "sinks": extra.get("sinks") is not None,
            }
            bad = [k for k, v in unsupported.items() if v]
            if bad:
                raise NotImplementedError(f"remote attention does not support {', '.join(bad)} yet")
            self.num_heads = num_heads
            self.head_size = head_size
            self.scale = float(scale)
            self.num_kv_heads = num_kv_heads or num_heads
            self._layer_idx: int | None = None
            self.nanoflow_network_bound = _NETWORK_BOUND  # n=1 runs the same impl serially
            # the client of the worker building this model (set before load_model): keeps two
            # in-process engines (a benchmark's A/B pair) on their own clients
            self._client = _CLIENT

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
            client = self._client if self._client is not None else get_client()
            pending = client.submit(self._layer_idx, query[:n], key[:n], value[:n], attn_metadata, self.scale)
            if _OVERLAP_HOOK is not None:
                _OVERLAP_HOOK(pending)
            # n=2 pipeline: sent from the dense unit right after KQV, waited on the "net" unit, so
            # the other nano-batch's request is already queued at the server (overlap.deferred_waits)
            if not defer_wait(partial(pending.wait, output[:n])):
                pending.wait(output[:n])
            return output

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

    _CLASSES.update(
        RemoteAttentionMetadataBuilder=RemoteAttentionMetadataBuilder, RemoteAttentionImpl=RemoteAttentionImpl,
        RemoteAttentionBackend=RemoteAttentionBackend, RemoteAttentionCudaBackend=RemoteAttentionCudaBackend,
    )
    return _CLASSES


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
