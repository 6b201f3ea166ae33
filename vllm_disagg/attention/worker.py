# SPDX-License-Identifier: Apache-2.0
"""Model-worker side of Lamina: a CPU worker and runner that hold no KV cache.

`DisaggAttentionWorker(CPUWorker)` installs the process-wide attention client in `init_device` and
connects it in `determine_available_memory` (model loaded, KV layout resolved: each layer's variant
travels in the INIT), reports the servers' capacity as its "available memory" (so the scheduler's
number of blocks is what the servers hold, not local RAM) and swaps in `DisaggAttentionRunner`,
which binds zero-byte placeholders (`meta` device) instead of allocating the cache and never
zeroes blocks locally.

More: README.md, "worker.py".
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_disagg.attention import backend, recovery, register
from vllm_disagg.attention.client import DisaggAttentionClient
from vllm_disagg.attention.partition import resolved_section
from vllm_disagg.attention.variants import (
    allocate_windows_in_full,
    check_block_size,
    check_request_wise_groups,
    collect_layer_attrs,
    pool_bytes_per_block,
)
from vllm_disagg.config import disagg_config_from_vllm
from vllm_disagg.patches import require
from vllm_disagg.patches.attn_backend_cache import clear_attn_backend_cache
from vllm_disagg.patches.runner_class_swap import swap_runner_class

logger = init_logger(__name__)
REQUIRED_PATCHES = ("runner_class_swap", "attn_backend_cache", "couplings")
register()  # the worker process imports this module before it builds the model


def client_from_config(vllm_config) -> DisaggAttentionClient | None:
    cfg = disagg_config_from_vllm(vllm_config)
    remote_attention = cfg.remote_attention if cfg else None
    if remote_attention is None or not remote_attention.servers:
        return None
    check_block_size(backend.remote_backend_cls(), vllm_config.cache_config.block_size)  # before the model loads
    remote_attention = resolved_section(remote_attention, vllm_config)
    client = DisaggAttentionClient(remote_attention.servers, transport=remote_attention.transport,
                                   partition=remote_attention.partition, send_q_early=remote_attention.send_q_early,
                                   timeout_s=remote_attention.timeout_s, auth_token=cfg.auth_token,
                                   spin_us=remote_attention.spin_us)
    client.replacement_wait_s = remote_attention.replacement_wait_s  # read by recovery.reconnect
    return client


def connect_client(client: DisaggAttentionClient, vllm_config, runner) -> int:
    """INIT the servers once the model is loaded: each layer's variant (window, soft-cap, ALiBi,
    sinks, fp8 scales) is read off the loaded layers, and anything unknown refuses to start."""
    mc, parallel_config = vllm_config.model_config, vllm_config.parallel_config
    specs = runner.get_kv_cache_spec()
    layers = collect_layer_attrs(vllm_config, specs)
    if client.partition == "request":
        check_request_wise_groups(vllm_config, specs)
    return client.connect(
        num_layers=mc.get_num_layers(parallel_config), num_heads=mc.get_num_attention_heads(parallel_config),
        num_kv_heads=mc.get_num_kv_heads(parallel_config), head_size=mc.get_head_size(),
        block_size=vllm_config.cache_config.block_size, dtype=str(mc.dtype).removeprefix("torch."),
        max_num_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype), layers=layers,
    )


def _forget_client() -> None:
    """A refused start leaves no half-set client (or cached remote backend) for a next in-process engine."""
    client = backend.current_client()
    if client is not None:
        client.close()
        backend.set_client(None)
        clear_attn_backend_cache()


class DisaggAttentionWorker(CPUWorker):
    """CPUWorker whose KV lives on attention servers (inert if remote attention is not set)."""

    def init_device(self) -> None:
        super().init_device()
        clear_attn_backend_cache()  # an earlier engine in this process may have cached the stock one
        client = client_from_config(self.vllm_config)
        if client is None:
            return
        require("remote attention", *REQUIRED_PATCHES)
        remote_attention = disagg_config_from_vllm(self.vllm_config).remote_attention  # pipeline: 1|2 (config.py)
        if remote_attention.pipeline == 2 and not getattr(self, "nanoflow_stats", None):
            raise ValueError("remote_attention.pipeline=2 runs on the nano-batch executor: use worker_cls "
                             "'vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker' with "
                             '"nanoflow": {"num_nano_batches": 2}')
        backend.set_client(client)  # before the model builds: its attention impls keep this client
        swap_runner_class(self.model_runner, DisaggAttentionRunner)

    def load_model(self) -> None:
        try:  # a layer remote attention cannot compute refuses here (variants.check_impl_args)
            super().load_model()
        except BaseException:
            _forget_client()
            raise

    def determine_available_memory(self) -> int:
        client = backend.current_client()
        if client is None:
            return super().determine_available_memory()
        try:  # the model is loaded and the KV layout resolved: its layers' variants and groups are known
            connect_client(client, self.vllm_config, self.model_runner)
        except BaseException:
            _forget_client()
            raise
        if self._should_warm_up_model():
            self.model_runner.warming_up_model()
        per_block = pool_bytes_per_block(self.vllm_config, self.model_runner.get_kv_cache_spec())
        logger.info("remote attention: %d blocks on the attention servers", client.num_blocks)
        return client.num_blocks * per_block

    def shutdown(self) -> None:
        _forget_client()
        super().shutdown()


class DisaggAttentionRunner(CPUModelRunner):
    """No local KV: placeholders only; recovery when an attention server is lost."""

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None):
        local = [g.backend.get_name() for groups in self.attn_groups for g in groups
                 if not g.backend.forward_includes_kv_cache_update]
        if local:  # a local kernel on a placeholder cache would write to nowhere
            raise RuntimeError(f"remote attention worker got local attention backends {local}")
        device, self.device = self.device, torch.device("meta")
        try:  # same shapes and bindings as vLLM's, zero bytes
            return super().initialize_kv_cache_tensors(kv_cache_config, kernel_block_sizes, None)
        finally:
            self.device = device

    def get_kv_cache_spec(self):
        """Sliding-window layers allocated in full (variants.allocate_windows_in_full), every partition:
        vLLM frees a running request's out-of-window blocks and gives them to other requests, but this
        worker's block table keeps their ids, and a recovery (recovery.rebuild_kv) recomputes the whole
        sequence through that table; request-wise placement also keys on a request's first block."""
        specs = super().get_kv_cache_spec()
        if backend.current_client() is None:
            return specs
        full = allocate_windows_in_full(specs)
        num_promoted = sum(full[n] is not specs[n] for n in specs)
        if num_promoted and not getattr(self, "_told_full_windows", False):
            self._told_full_windows = True
            logger.info("remote attention: %d sliding-window layers allocated in full (a recovery rebuilds whole "
                        "sequences; the window is still computed)", num_promoted)
        return full

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        pass  # the servers own the blocks; attention never reads past seq_len

    def _model_forward(self, *args, **kwargs):
        return recovery.forward_with_recovery(self, super()._model_forward, *args, **kwargs)
