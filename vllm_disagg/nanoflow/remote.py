# SPDX-License-Identifier: Apache-2.0
"""Remote attention (Lamina) on the nano-batch executor: n nano-batches in flight, n=2 = ping-pong.

`--worker-cls vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker` with both
`remote_attention` and `nanoflow` in `additional_config["disagg"]`. The attention ops of every
layer run on the "net" unit (the remote impl is network-bound), so while nano-batch i waits for
its attention servers, the "dense" unit computes nano-batch i+1. Composition only: the remote
worker/runner are the Lamina helper's (`vllm_disagg.attention.worker`).
"""

from __future__ import annotations

from vllm_disagg.attention import backend as remote_backend
from vllm_disagg.attention.worker import DisaggAttentionWorker
from vllm_disagg.nanoflow.overlap import NETWORK_BOUND_ATTR
from vllm_disagg.nanoflow.runner import enable_nano_ubatching, nanoflow_runner_cls, runner_stats


def mark_remote_impl_network_bound() -> None:
    impl = remote_backend._classes()["RemoteAttentionImpl"]
    if not getattr(impl, NETWORK_BOUND_ATTR, False):
        setattr(impl, NETWORK_BOUND_ATTR, True)


class NanoFlowRemoteAttentionWorker(DisaggAttentionWorker):
    """DisaggAttentionWorker whose runner also nano-batches (inert parts stay inert)."""

    def init_device(self) -> None:
        enable_nano_ubatching(self.vllm_config)
        mark_remote_impl_network_bound()
        super().init_device()
        runner = self.model_runner  # DisaggAttentionRunner when remote attention is configured
        runner.__class__ = nanoflow_runner_cls(type(runner))
        runner.init_nanoflow(self.vllm_config)

    def nanoflow_stats(self) -> dict:
        return runner_stats(self.model_runner)
