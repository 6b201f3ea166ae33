# SPDX-License-Identifier: Apache-2.0
"""`DisaggConnector`: the Splitwise layer-wise KV push connector, a pure-delegation facade.

Load it with `--kv-transfer-config '{"kv_connector":"DisaggConnector",
"kv_connector_module_path":"vllm_disagg.kv.connector","kv_role":"kv_producer"|"kv_consumer"}'`
(no registration needed). The scheduler instance (EngineCore) delegates to
`DisaggConnectorScheduler`, the worker instance to `DisaggConnectorWorker`; see README.md in this
package for the lifecycle and the request protocol (docs/design/pd_protocol.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from vllm_disagg.kv.layer_specs import check_push_specs
from vllm_disagg.kv.metadata import DisaggConnectorMetadata
from vllm_disagg.kv.stats import DisaggKVConnectorStats, DisaggKVPromMetrics
from vllm_disagg.patches import require

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["DisaggConnector"]

CONSUMER_PATCHES = ("scheduler_fatal_kv_failure",)
"""Without P4 a handshake mismatch would be recomputed quietly instead of failing its request."""


class DisaggConnector(KVConnectorBase_V1, SupportsHMA):
    """`SupportsHMA`: vLLM keeps its hybrid KV cache allocator on under this connector, so a model's
    sliding-window layers hold only their window's blocks on P and D; the push ships each layer's
    blocks by its own group's block table (README.md, "KV cache groups")."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        check_push_specs(kv_cache_config)  # refuses KV cache specs and fields the push does not know
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            if vllm_config.kv_transfer_config.is_kv_consumer:
                require("the KV consumer (kv_role kv_consumer)", *CONSUMER_PATCHES)
            from vllm_disagg.kv.scheduler import DisaggConnectorScheduler
            from vllm_disagg.kv.worker import kv_settings

            kv, token = kv_settings(vllm_config)
            self.connector_scheduler = DisaggConnectorScheduler(
                vllm_config.cache_config.block_size, kv.push_timeout_s,
                _reuse_scheduler(vllm_config, token, lambda: self._kv_cache_manager),
                kv_cache_manager=lambda: self._kv_cache_manager)
        else:
            from vllm_disagg.kv.worker import DisaggConnectorWorker

            self.connector_worker = DisaggConnectorWorker(vllm_config, kv_cache_config=kv_cache_config)

    # ==============================
    # Scheduler Side Methods
    # ==============================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The push holds every group's blocks until it is over (delay-free covers them all)."""
        return self.connector_scheduler.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def is_fatal_load_failure(self, req_id: str) -> bool:
        """True when a decode request's push failed for a configuration error (handshake mismatch)."""
        return self.connector_scheduler is not None and self.connector_scheduler.is_fatal_load_failure(req_id)

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DisaggKVConnectorStats:
        return DisaggKVConnectorStats(data=data) if data is not None else DisaggKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> DisaggKVPromMetrics:
        return DisaggKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==============================
    # Worker Side Methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, DisaggConnectorMetadata)
        self.connector_worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """P/D: nothing to load (the prefill side pushes into our blocks); Lamina: restore retained blocks."""
        self.connector_worker.start_load_kv()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.take_load_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request is scheduled only after its whole push landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.connector_worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.connector_worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.connector_worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.connector_worker.get_transfer_results()
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.connector_worker.build_worker_meta()

    def get_kv_connector_stats(self) -> DisaggKVConnectorStats | None:
        return self.connector_worker.get_kv_connector_stats() if self.connector_worker else None

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


def _reuse_scheduler(vllm_config: VllmConfig, token: str | None, kv_cache_manager: Any) -> Any:
    """A Lamina model worker's `DisaggReuseScheduler` (kv/lamina/reuse.py), else None."""
    from vllm_disagg.kv.lamina.targets import attention_settings

    remote_attention = attention_settings(vllm_config)
    if remote_attention is None or not token:
        return None
    from vllm_disagg.kv.lamina.reuse import DisaggReuseScheduler

    return DisaggReuseScheduler.from_config(vllm_config, remote_attention, token, kv_cache_manager)
