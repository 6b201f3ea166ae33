# SPDX-License-Identifier: Apache-2.0
"""Worker wiring on a real VllmConfig: inert without the nanoflow section, worker-local ubatching with it."""

from __future__ import annotations

import pytest

from vllm_disagg.testing import tiny_llm_kwargs


def _vllm_config(model_dir: str, **over):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = tiny_llm_kwargs(model_dir, **over)
    kwargs.pop("seed", None)
    return EngineArgs(**kwargs).create_engine_config()


def test_without_the_nanoflow_section_the_worker_changes_nothing(tiny_model_dir):
    from vllm_disagg.nanoflow.worker import enable_nano_ubatching

    cfg = _vllm_config(tiny_model_dir)
    assert enable_nano_ubatching(cfg) == 0
    assert not cfg.parallel_config.use_ubatching


def test_four_nano_batches_turn_on_vllms_ubatch_path_in_the_worker_config(tiny_model_dir):
    from vllm_disagg.nanoflow.runner import nanoflow_plan_of
    from vllm_disagg.nanoflow.worker import enable_nano_ubatching

    cfg = _vllm_config(tiny_model_dir, additional_config={"disagg": {"nanoflow": {"nano_batches": 4}}})
    assert enable_nano_ubatching(cfg) == 4
    assert cfg.parallel_config.use_ubatching and cfg.parallel_config.num_ubatches == 4
    plan = nanoflow_plan_of(cfg)
    assert (plan.nano_batches.attn, plan.nano_batches.dense) == (4, 2)


def test_a_bad_nano_batch_count_fails_with_the_key_in_the_message(tiny_model_dir):
    from vllm_disagg.config import DisaggConfigError
    from vllm_disagg.nanoflow.runner import nanoflow_plan_of

    with pytest.raises(DisaggConfigError, match="nanoflow.nano_batches"):
        nanoflow_plan_of(
            _vllm_config(tiny_model_dir, additional_config={"disagg": {"nanoflow": {"nano_batches": 0}}})
        )


def test_the_gpu_worker_and_runner_classes_import_without_a_gpu():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_disagg.nanoflow.runner import NanoFlowRunnerMixin, nanoflow_runner_cls
    from vllm_disagg.nanoflow.worker import NanoFlowGPUWorker

    cls = nanoflow_runner_cls(GPUModelRunner)
    assert cls.__mro__[1] is NanoFlowRunnerMixin and issubclass(cls, GPUModelRunner)
    assert nanoflow_runner_cls(GPUModelRunner) is cls
    assert NanoFlowGPUWorker._make_model_runner is not None


def test_the_plain_nano_worker_points_remote_attention_users_to_the_composed_worker(tiny_model_dir):
    from vllm_disagg.nanoflow.worker import _refuse_remote_attention

    disagg = {"nanoflow": {"nano_batches": 2}, "remote_attention": {"servers": ["127.0.0.1:9"]}}
    with pytest.raises(ValueError, match="NanoFlowRemoteAttentionWorker"):
        _refuse_remote_attention(_vllm_config(tiny_model_dir, additional_config={"disagg": disagg}))
