# SPDX-License-Identifier: Apache-2.0
"""Nano-batch workers: `--worker-cls vllm_disagg.nanoflow.worker.NanoFlowCPUWorker` (CPU) or
`vllm_disagg.nanoflow.worker.NanoFlowGPUWorker` (CUDA; needs `VLLM_USE_V2_MODEL_RUNNER=0` and
`enforce_eager`, untested here).

Both are inert unless `additional_config["disagg"]["nanoflow"]` is set. When it is, the worker sets
the *worker-local* `parallel_config.ubatch_size` to the fine nano-batch count before the runner is
built: vLLM then builds per-ubatch attention-metadata builders, and the config was already
validated, which sidesteps the DBO-only all2all assertion in `VllmConfig.__post_init__`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vllm_disagg.nanoflow.runner import nanoflow_plan_of, nanoflow_runner_cls

logger = logging.getLogger(__name__)


def enable_nano_ubatching(vllm_config: Any) -> int:
    """Turn on vLLM's ubatch plumbing in this worker for the configured plan; returns the fine
    nano-batch count (0 when nanoflow is off or the count is 1)."""
    plan = nanoflow_plan_of(vllm_config)
    if plan is None or plan.nano_batches.attn < 2:
        return 0
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1 or pc.enable_dbo or pc.pipeline_parallel_size > 1:
        raise ValueError(
            "nanoflow: nano-batching does not combine with data/pipeline parallelism or DBO "
            f"(dp={pc.data_parallel_size}, pp={pc.pipeline_parallel_size}, dbo={pc.enable_dbo}); "
            'remove additional_config["disagg"]["nanoflow"] or those flags'
        )
    n = plan.nano_batches.attn
    pc.ubatch_size = n
    pc.dbo_decode_token_threshold = max(n, 1)
    pc.dbo_prefill_token_threshold = max(n, 1)
    return n


def _runner_stats(runner: Any) -> dict:
    stats = dict(getattr(runner, "nano_stats", {}) or {})
    tput = getattr(runner, "_nano_tput", None)
    if tput is not None:
        stats.update(tput.summary())
    executor = getattr(runner, "nano_executor", None)
    if executor is not None:
        stats["units"] = [u.describe() for u in executor.units.values()]
        stats["inline"] = executor.inline
    stats["pipeline"] = getattr(runner, "nano_pipeline", None) is not None
    return stats


class NanoFlowCPUWorker(CPUWorker):
    """CPUWorker whose runner nano-batches each step (see `runner.NanoFlowRunnerMixin`)."""

    def runner_base_cls(self) -> type:
        """The runner to nano-batch; override to compose with another plugin runner."""
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        return CPUModelRunner

    def init_device(self) -> None:
        import vllm.v1.worker.cpu_worker as cpu_worker_mod

        if not enable_nano_ubatching(self.vllm_config):
            return super().init_device()
        if self.use_v2_model_runner:
            raise ValueError("nanoflow needs the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        # CPUWorker.init_device builds CPUModelRunner inline: swap the name for the call.
        original = cpu_worker_mod.CPUModelRunner
        cpu_worker_mod.CPUModelRunner = nanoflow_runner_cls(self.runner_base_cls())
        try:
            super().init_device()
        finally:
            cpu_worker_mod.CPUModelRunner = original

    def nanoflow_stats(self) -> dict:
        """collective_rpc("nanoflow_stats"): step counters, units and throughput vs optimal."""
        return _runner_stats(self.model_runner)


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
        return _runner_stats(self.model_runner)
