# SPDX-License-Identifier: Apache-2.0
"""Remote attention (Lamina) on the nano-batch executor: the one overlap mechanism for both.

More: README.md, "remote.py".
"""

from __future__ import annotations

from typing import Any

from vllm_disagg.attention import backend as remote_backend
from vllm_disagg.attention import recovery
from vllm_disagg.attention.worker import DisaggAttentionRunner, DisaggAttentionWorker
from vllm_disagg.config import disagg_config_from_vllm
from vllm_disagg.nanoflow.runner import enable_nano_ubatching, nanoflow_runner_cls, runner_stats
from vllm_disagg.patches import require
from vllm_disagg.patches.runner_class_swap import swap_runner_class


def mark_remote_impl_network_bound(bound: bool = True) -> None:
    """Set before the model binds its pipeline (each impl reads it once, when built)."""
    remote_backend.set_network_bound(bound)


def pipeline_depth(vllm_config) -> int:
    cfg = disagg_config_from_vllm(vllm_config)
    remote_attention = cfg.remote_attention if cfg is not None else None
    # this worker exists to overlap: ping-pong unless the config asks for depth 1 explicitly
    return remote_attention.pipeline if remote_attention is not None and "pipeline" in remote_attention.model_fields_set else 2


class RemoteRecoveryMixin:
    """Outermost `_model_forward`: a server lost on a unit thread fails the whole split step,
    which is then recovered and re-run here (the inner, per-runner wrapper passes through)."""

    def _model_forward(self, *args: Any, **kwargs: Any):
        return recovery.forward_with_recovery(self, super()._model_forward, *args, **kwargs)


_REMOTE_RUNNER_CLASSES: dict[type, type] = {}


def remote_nanoflow_runner_cls(base: type) -> type:
    """Nano-batch runner over `base`; with recovery outermost when `base` is the remote runner."""
    cls = nanoflow_runner_cls(base)
    if not issubclass(base, DisaggAttentionRunner):
        return cls  # remote attention not configured: plain nano-batching, nothing to recover
    if cls not in _REMOTE_RUNNER_CLASSES:
        _REMOTE_RUNNER_CLASSES[cls] = type(f"Recovering{cls.__name__}", (RemoteRecoveryMixin, cls),
                                           {"__module__": __name__})
    return _REMOTE_RUNNER_CLASSES[cls]


class NanoFlowRemoteAttentionWorker(DisaggAttentionWorker):
    """DisaggAttentionWorker whose runner also nano-batches (inert parts stay inert)."""

    def init_device(self) -> None:
        depth = pipeline_depth(self.vllm_config)  # 1 or 2: the config refuses other depths at parse time
        enable_nano_ubatching(self.vllm_config)
        mark_remote_impl_network_bound(depth >= 2)
        super().init_device()
        runner = self.model_runner  # DisaggAttentionRunner when remote attention is configured
        require("nano-batching with remote attention", "runner_class_swap")
        swap_runner_class(runner, remote_nanoflow_runner_cls(type(runner)))
        runner.init_nanoflow(self.vllm_config)

    def nanoflow_stats(self) -> dict:
        """runner_stats plus `remote_recoveries`: one entry per recovered server loss."""
        stats = runner_stats(self.model_runner)
        stats["remote_recoveries"] = list(getattr(self.model_runner, "remote_recovery_log", []))
        return stats
