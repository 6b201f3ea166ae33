# SPDX-License-Identifier: Apache-2.0
"""Upstream couplings: private vLLM methods the plugin overrides or calls, without patching them.

They are not patches (vLLM's code is untouched), but a vLLM release can rename them or change
what they take and return, silently. Each row names the symbol, the plugin code that depends on it,
the parameters it had, and the vLLM version it was last read against. `tests/patches/test_couplings.py`
fails as soon as the installed vLLM is another version, until every row has been re-read and its
`checked_against` bumped; at run time the features that rely on them refuse another minor version.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from vllm_disagg.patches.compat import version_ok

NAME = "couplings"
UPSTREAM = "vllm/v1/worker: private model-runner and worker methods (patches/README.md)"


@dataclass(frozen=True)
class Coupling:
    symbol: str
    """module:Owner.attr (or module:function)."""
    users: tuple[str, ...]
    how: str
    params: tuple[str, ...]
    checked_against: str

    def resolve(self):
        module, _, path = self.symbol.partition(":")
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def current_params(self) -> tuple[str, ...]:
        return tuple(inspect.signature(self.resolve()).parameters)


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
COUPLINGS = [
    Coupling(f"{_RUNNER}._model_forward",
             ("attention.worker.DisaggAttentionRunner", "nanoflow.runner.NanoFlowRunnerMixin",
              "nanoflow.remote.RemoteRecoveryMixin"),
             "override; wraps the forward (nano-batch split, server-loss recovery), calls super",
             ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds", "model_kwargs"), "0.32.0"),
    Coupling(f"{_RUNNER}._build_attention_metadata", ("nanoflow.runner.NanoFlowRunnerMixin",),
             "override; reads kwarg ubatch_slices, sets the OpenMP width, calls super",
             ("self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
              "ubatch_slices", "logits_indices", "max_num_sampled_tokens", "use_spec_decode",
              "for_cudagraph_capture", "num_scheduled_tokens", "slot_mappings"), "0.32.0"),
    Coupling(f"{_RUNNER}._determine_batch_execution_and_padding", ("nanoflow.runner.NanoFlowRunnerMixin",),
             "override; unpacks its 5-tuple and sets should_ubatch (reads num_tokens, num_reqs, "
             "num_scheduled_tokens_np, allow_microbatching)",
             ("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens",
              "use_cascade_attn", "allow_microbatching", "force_eager", "force_uniform_decode", "force_has_lora",
              "force_num_active_loras", "num_encoder_reqs"), "0.32.0"),
    Coupling(f"{_RUNNER}.initialize_kv_cache_tensors", ("attention.worker.DisaggAttentionRunner",),
             "override; binds meta-device placeholders, calls super without the allocation context",
             ("self", "kv_cache_config", "kernel_block_sizes", "kv_cache_allocation_context"), "0.32.0"),
    Coupling(f"{_RUNNER}.get_kv_cache_spec", ("attention.worker.DisaggAttentionRunner",),
             "override; sliding-window specs become FullAttentionSpec (vLLM's own promotion for hybrid "
             "models with the hybrid manager off), calls super", ("self",), "0.32.0"),
    Coupling("vllm.v1.kv_cache_interface:replace_as", ("attention.variants.allocate_windows_in_full",),
             "called: SlidingWindowSpec -> FullAttentionSpec, dropping extra_retained_tokens",
             ("spec", "target_cls", "drop", "changes"), "0.32.0"),
    Coupling("vllm.v1.worker.cpu_model_runner:CPUModelRunner._zero_block_ids",
             ("attention.worker.DisaggAttentionRunner",), "override; a no-op (the servers own the blocks)",
             ("self", "block_ids"), "0.32.0"),
    Coupling("vllm.v1.worker.gpu_worker:Worker._make_model_runner", ("nanoflow.gpu_worker.NanoFlowGPUWorker",),
             "override; builds the nano-batch runner", ("self",), "0.32.0"),
    Coupling("vllm.v1.attention.backend:AttentionBackend.supports_block_size",
             ("attention.variants.check_block_size",), "called", ("block_size",), "0.32.0"),
    Coupling("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_kernel_block_sizes",
             ("attention.variants.check_block_size",), "called (the refusal's message)", ("kv_cache_spec",), "0.32.0"),
    Coupling("vllm.v1.worker.cpu_worker:CPUWorker._should_warm_up_model",
             ("attention.worker.DisaggAttentionWorker.determine_available_memory",), "called", ("self",), "0.32.0"),
    Coupling("vllm._custom_ops:cpu_attn_get_scheduler_metadata", ("attention.kernels.CpuAttentionKernel.prepare",),
             "called with keywords",
             ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype", "query_start_loc", "causal",
              "sliding_window_size", "isa", "enable_kv_split", "dynamic_causal", "kv_cache_dtype"), "0.32.0"),
    Coupling("vllm._custom_ops:cpu_attn_reshape_and_cache", ("attention.kernels.CpuAttentionKernel.write_kv",), "called",
             ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale", "v_scale",
              "kv_cache_dtype"), "0.32.0"),
    Coupling("vllm.v1.core.kv_cache_utils:get_kv_cache_groups", ("attention.variants.kv_groups",),
             "called on a copy of the runner's specs: each layer's scheduler window and block cost follow "
             "vLLM's own KV groups", ("vllm_config", "kv_cache_spec"), "0.32.0"),
    Coupling("vllm.model_executor.models.utils:extract_layer_index", ("attention.variants.collect_layer_attrs",),
             "called; also reads each Attention's impl.sliding_window/sinks/alibi_slopes/logits_soft_cap and the "
             "private layer._k_scale_float/_v_scale_float (instance attributes: re-read by hand)",
             ("layer_name", "num_attn_module"), "0.32.0"),
    Coupling("vllm._custom_ops:reshape_and_cache_flash", ("attention.kernels.FlashAttentionKernel.write_kv",),
             "called positionally (GPU only)",
             ("key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale", "v_scale"),
             "0.32.0"),
]


def apply(hooks=None) -> bool:
    """Nothing to install: 'applied' means the installed vLLM is the minor version they were read on."""
    return version_ok(NAME)
