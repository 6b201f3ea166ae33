# SPDX-License-Identifier: Apache-2.0
"""The CUDA nano-batch worker: `--worker-cls vllm_disagg.nanoflow.gpu_worker.NanoFlowGPUWorker`.

Needs the V1 runner (`VLLM_USE_V2_MODEL_RUNNER=0`: the V2 runner has no `_model_forward` hook) and
`enforce_eager=True`. Units are SM-limited streams (CUDA green contexts, `units.CudaSmStream`).
UNTESTED HERE: no GPU on this box; the logic it shares with the CPU worker is tested there.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_disagg.nanoflow.runner import (
    enable_nano_ubatching,
    nanoflow_plan_of,
    nanoflow_runner_cls,
    reset_runner_stats,
    runner_stats,
)


class NanoFlowGPUWorker(Worker):
    """GPU Worker with the nano-batch runner; units are SM-limited streams (green contexts)."""

    def runner_base_cls(self) -> type:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner

    def init_device(self) -> None:
        enable_nano_ubatching(self.vllm_config)
        super().init_device()

    def _make_model_runner(self):
        if nanoflow_plan_of(self.vllm_config) is None:
            return super()._make_model_runner()
        if self.use_v2_model_runner:
            raise ValueError("nanoflow needs the V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0")
        return nanoflow_runner_cls(self.runner_base_cls())(self.vllm_config, self.device)

    def nanoflow_stats(self) -> dict:
        return runner_stats(self.model_runner)

    def nanoflow_reset_stats(self) -> None:
        reset_runner_stats(self.model_runner)
