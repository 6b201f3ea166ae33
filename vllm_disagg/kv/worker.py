# SPDX-License-Identifier: Apache-2.0
"""Worker half of `DisaggConnector` (runs in each vLLM worker process).

On `register_kv_caches` it builds this worker's `HandshakeInfo`, opens the transport named by
`kv.transport`, and starts the role's side: `PushSender` (kv_producer: side channel on
`kv.kv_port`, sender thread) and/or `PushReceiver` (kv_consumer: KV receiver with one region per
layer). Per step: `bind` hands the metadata to them, `save_kv_layer` marks a layer written behind an
event on the forward stream (`layer_events.py`; the sender pushes its whole blocks once the event
completed) and tells `/live` that the step moves (`liveness.LayerBeacon`), `wait_for_save` marks the
step's forward done, `get_transfer_results` reports pushes that are over and receives that landed or
failed. Nothing here blocks the forward pass except `bind` after a preemption (bounded). A Lamina
model worker's extra steps (restoring retained blocks, registering written ones, CLAIMs before a
push): README.md, "worker.py".
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from vllm_disagg import envs
from vllm_disagg.attention.spans import set_step_trace
from vllm_disagg.config import DisaggConfigError, KVTransferSection, disagg_config_from_vllm
from vllm_disagg.kv.handshake import local_handshake_info
from vllm_disagg.kv.layer_events import device_events
from vllm_disagg.kv.layer_specs import check_uniform_layers, layer_groups
from vllm_disagg.kv.metadata import CancelSpec, DisaggConnectorMetadata, DisaggWorkerMetadata, RecvSpec
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.liveness import LayerBeacon
from vllm_disagg.transport import Transport, TransportOptions, get_transport

if TYPE_CHECKING:
    import torch

    from vllm_disagg.kv.push_receiver import PushReceiver
    from vllm_disagg.kv.push_sender import PushSender

__all__ = ["DisaggConnectorWorker", "kv_settings"]
SpecT = TypeVar("SpecT", RecvSpec, CancelSpec)

logger = init_logger(__name__)


def kv_settings(vllm_config: Any) -> tuple[KVTransferSection, str | None]:
    """The `kv` section (defaults when absent) and the shared auth token."""
    cfg = disagg_config_from_vllm(vllm_config)
    kv = (cfg.kv if cfg else None) or KVTransferSection()
    return kv, (cfg.auth_token if cfg else None) or envs.auth_token()


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


class DisaggConnectorWorker:
    def __init__(self, vllm_config: Any, make_transport: Callable[..., Transport] | None = None,
                 kv_cache_config: Any = None):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        """vLLM's KV cache groups: which block table addresses each layer (`layer_specs.layer_groups`)."""
        self.kv, self.token = kv_settings(vllm_config)
        kv_transfer = vllm_config.kv_transfer_config
        self.is_producer = kv_transfer.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_transfer.kv_role in ("kv_consumer", "kv_both")
        self._make_transport = make_transport or _default_transport
        self._stats = DisaggKVConnectorStats()
        self._stats_lock = threading.Lock()
        self.layer_ids: dict[str, int] = {}
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None  # or its Lamina subclass, AttnPushReceiver
        self.events = device_events("cpu")
        """Where `save_kv_layer` records its per-layer event: the KV tensors' device."""
        self._recoveries_sent = 0  # attention-server recoveries the scheduler was told of
        self.progress = LayerBeacon()
        """Tells this instance's API server that a layer finished: a long step is not a hang (`/live`)."""
        from vllm_disagg.kv.lamina.targets import attention_settings

        self._attention = attention_settings(vllm_config)
        """remote_attention of a Lamina model worker: its KV tensors are placeholders, pushes go to servers."""
        self.reuse = None
        """Lamina model worker: restores/registers blocks on the attention servers (kv/lamina/reuse.py)."""
        if self._attention is not None:
            from vllm_disagg.kv.lamina.reuse import DisaggReuseWorker

            self.reuse = DisaggReuseWorker(self._attention.timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.token:
            raise DisaggConfigError(
                'DisaggConnector needs a shared auth token: set additional_config["disagg"].auth_token '
                f"or ${envs.VLLM_DISAGG_AUTH_TOKEN} to the same secret on prefill and decode instances"
            )
        names = sorted(kv_caches, key=_layer_index)
        self.layer_ids = {name: i for i, name in enumerate(names)}
        layers = [kv_caches[n] for n in names]
        if self._attention is not None and self.is_producer:
            raise DisaggConfigError("a remote-attention model worker holds no KV to send: it can only be "
                                    "a decode (kv_consumer) instance")
        for name, tensor in zip(names, layers, strict=True):
            if not tensor.is_contiguous():
                raise ValueError(f"DisaggConnector ships whole blocks and needs contiguous KV; {name} is not")
        check_uniform_layers(names, layers)
        self.events = device_events(layers[0].device) if layers else self.events
        groups = layer_groups(names, self.kv_cache_config)
        if self._attention is not None and any(groups):
            raise DisaggConfigError("a remote-attention model worker needs one KV cache group; run it with "
                                    "--disable-hybrid-kv-cache-manager")
        info = local_handshake_info(self.vllm_config, layers, groups)
        stats = (self._stats, self._stats_lock)
        port = self._port()
        # The side channel is always tcp on kv_port (a HOST:PORT the router can hand out);
        # the KV bytes use kv.transport (tcp, shm, nixl, ...).
        if self.is_producer:
            from vllm_disagg.kv.push_sender import PushSender

            self.sender = PushSender(self._make_transport(self.kv, self.token, "tcp", port),
                                     self._make_transport(self.kv, self.token, self.kv.transport, 0),
                                     info, self.token, layers, self.kv, stats)
        if self.is_consumer and self._attention is not None:  # Lamina: KV lands on the attention servers
            from vllm_disagg.kv.lamina.targets import AttnPushReceiver

            self.receiver = AttnPushReceiver(self._make_transport(self.kv, self.token, "tcp", 0), info, self.token,
                                             stats, self.vllm_config.kv_transfer_config.kv_load_failure_policy,
                                             self._attention, verify=self.kv.verify_checksums,
                                             recompute_slow_pushes=self.kv.recompute_slow_pushes)
        elif self.is_consumer:
            from vllm_disagg.kv.push_receiver import PushReceiver

            rx_port = 0 if self.is_producer or self.kv.transport != "tcp" else port
            self.receiver = PushReceiver(self._make_transport(self.kv, self.token, "tcp", 0),
                                         self._make_transport(self.kv, self.token, self.kv.transport, rx_port),
                                         info, self.token, layers, stats,
                                         self.vllm_config.kv_transfer_config.kv_load_failure_policy,
                                         self._advertised(), verify=self.kv.verify_checksums,
                                         recompute_slow_pushes=self.kv.recompute_slow_pushes)

    def _advertised(self) -> str | None:
        """`kv.advertise_address` for this rank: rank r advertises PORT + r, as it listens on kv_port + r."""
        if not self.kv.advertise_address:
            return None
        host, _, port = self.kv.advertise_address.rpartition(":")
        return f"{host}:{int(port) + self.rank}"

    @property
    def rank(self) -> int:
        return int(getattr(self.vllm_config.parallel_config, "rank", 0) or 0)

    def _port(self) -> int:
        """kv_port + this worker's rank (each TP rank serves its own KV-head slice); 0 stays 0 (any
        port), which only a single-rank prefill instance can use: D finds rank r at remote_port + r."""
        if not self.kv.kv_port:
            if self.is_producer and self.rank:
                raise DisaggConfigError("a tensor-parallel prefill instance needs a fixed kv.kv_port: rank r "
                                        "serves its side channel on kv_port + r, where decode rank r finds it")
            return 0
        return self.kv.kv_port + self.rank

    # ------------------------------------------------------------ per step
    def bind(self, meta: DisaggConnectorMetadata) -> None:
        if self.sender is not None and (meta.save_specs or meta.release_req_ids or meta.preempted_req_ids
                                    or meta.abandoned_req_ids):
            self.sender.bind(meta)
        if self.reuse is not None:  # first: registrations queued now ride on the receiver's CLAIM, ahead of it
            self.reuse.bind(meta.reuse)
            set_step_trace(meta.step_trace)
        if self.receiver is not None and meta.recv_specs:
            self.receiver.start([rank_spec(spec, self.rank) for spec in meta.recv_specs])
        if self.receiver is not None and meta.cancel_specs:
            self.receiver.cancel([rank_spec(spec, self.rank) for spec in meta.cancel_specs])

    def start_load_kv(self) -> None:
        if self.reuse is not None:
            self.reuse.start_load()

    def take_load_errors(self) -> set[int]:
        """Blocks whose restore failed this step: vLLM recomputes them (kv_load_failure_policy)."""
        return self.reuse.take_load_errors() if self.reuse is not None else set()

    def save_kv_layer(self, layer_name: str) -> None:
        layer_idx = self.layer_ids.get(layer_name)
        if layer_idx is None:
            return
        self.progress.layer_done(layer_idx, len(self.layer_ids))
        if self.sender is not None:
            self.sender.layer_saved(layer_idx, self.events.record())

    def wait_for_save(self) -> None:
        if self.sender is not None:
            self.sender.step_done(self.events.record())

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self.sender is not None:
            results.finished_sending = self.sender.finished_sending()
        if self.receiver is not None:
            results.finished_recving, results.failed_recving = self.receiver.poll()
        return results

    def build_worker_meta(self) -> DisaggWorkerMetadata | None:
        errors = self.receiver.take_errors() if self.receiver is not None else {}
        recoveries = _attention_recoveries()
        if not errors and recoveries == self._recoveries_sent:
            return None
        self._recoveries_sent = recoveries
        return DisaggWorkerMetadata(errors={r: e for r, (e, _) in errors.items()},
                                    fatal={r for r, (_, fatal) in errors.items() if fatal},
                                    attention_recoveries=recoveries)

    def get_kv_connector_stats(self) -> DisaggKVConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()

    def shutdown(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        self.progress.close()


def rank_spec(spec: SpecT, rank: int) -> SpecT:
    """`spec` (a RecvSpec or CancelSpec) for TP rank `rank`: the router names P's rank-0 side channel
    (remote_port); rank r talks to P's rank r at remote_port + r, which holds the same KV-head slice."""
    if not rank:
        return spec
    host, _, port = spec.remote.rpartition(":")
    return dataclasses.replace(spec, remote=f"{host}:{int(port) + rank}")


def _default_transport(kv: KVTransferSection, token: str, kind: str, port: int) -> Transport:
    host = os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
    options = TransportOptions(auth_token=token, host=host, port=port, num_streams=kv.num_streams,
                               timeout_s=kv.push_timeout_s)
    return get_transport(kind, options)


def _attention_recoveries() -> int:
    """Server losses this process's remote-attention client recovered from (0 without one)."""
    from vllm_disagg.attention.runtime import current_client

    client = current_client()
    return getattr(client, "num_recoveries", 0) if client is not None else 0
