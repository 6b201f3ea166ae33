# SPDX-License-Identifier: Apache-2.0
"""Nano-batch workers: `--worker-cls vllm_disagg.nanoflow.worker.NanoFlowCPUWorker` (CPU) or
`vllm_disagg.nanoflow.gpu_worker.NanoFlowGPUWorker` (CUDA; needs `VLLM_USE_V2_MODEL_RUNNER=0` and
`enforce_eager`, untested here).

Both are inert unless `additional_config["disagg"]["nanoflow"]` is set. When it is, the worker sets
the *worker-local* `parallel_config.ubatch_size` to the fine nano-batch count before the runner is
built: vLLM then builds per-ubatch attention-metadata builders, and the config was already
validated, which sidesteps the DBO-only all2all assertion in `VllmConfig.__post_init__`.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_disagg.config import disagg_config_from_vllm
from vllm_disagg.nanoflow.runner import (
    enable_nano_ubatching,
    nanoflow_runner_cls,
    reset_runner_stats,
    runner_stats,
)
from vllm_disagg.patches import require
from vllm_disagg.patches.cpu_worker_runner import building_cpu_runner

logger = init_logger(__name__)


def _refuse_remote_attention(vllm_config) -> None:
    cfg = disagg_config_from_vllm(vllm_config)
    if cfg is not None and cfg.remote_attention is not None:
        raise ValueError(
            "nanoflow with remote_attention needs the composed worker: "
            "--worker-cls vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"
        )


class NanoFlowCPUWorker(CPUWorker):
    """CPUWorker whose runner nano-batches each step (see `runner.NanoFlowRunnerMixin`)."""

    def runner_base_cls(self) -> type:
        """The runner to nano-batch; override to compose with another plugin runner."""
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return CPUModelRunner

    def init_device(self) -> None:
        if type(self).runner_base_cls is NanoFlowCPUWorker.runner_base_cls:
            _refuse_remote_attention(self.vllm_config)  # a subclass may compose its own runner
        if not enable_nano_ubatching(self.vllm_config):
            return super().init_device()
        if self.use_v2_model_runner:
            raise ValueError("nanoflow needs the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        require("nano-batching", "cpu_worker_runner")
        with building_cpu_runner(nanoflow_runner_cls(self.runner_base_cls())):
            super().init_device()

    def nanoflow_stats(self) -> dict:
        """collective_rpc("nanoflow_stats"): step counters, units and throughput vs optimal."""
        return runner_stats(self.model_runner)

    def nanoflow_reset_stats(self) -> None:
        """collective_rpc("nanoflow_reset_stats"): start the counters over (e.g. after a warm-up)."""
        reset_runner_stats(self.model_runner)

    def shutdown(self) -> None:
        """Stop the unit threads before vLLM tears the worker down (they hold pinned OpenMP teams)."""
        executor = getattr(getattr(self, "model_runner", None), "nano_executor", None)
        if executor is not None:
            executor.shutdown()
        super().shutdown()


# GPU: its own module, so a CUDA wheel never imports the CPU worker (and vice versa)
from vllm_disagg.nanoflow.gpu_worker import NanoFlowGPUWorker  # noqa: E402

__all__ = ["NanoFlowCPUWorker", "NanoFlowGPUWorker", "enable_nano_ubatching"]
