# SPDX-License-Identifier: Apache-2.0
"""Discrete batching: a loaded plan sets the scheduler's token budget unless the user chose one."""

from __future__ import annotations

import pytest

from vllm_disagg.config import parse_disagg_config
from vllm_disagg.nanoflow.plan import NanoFlowPlan, apply_discrete_batching
from vllm_disagg.testing import tiny_llm_kwargs


def _plan(tmp_path, dense_batch_size: int | None):
    path = tmp_path / "plan.json"
    NanoFlowPlan(dense_batch_size=dense_batch_size, fast_sizes=[32, 96]).save(path)
    return str(path)


def _engine_config(model_dir: str, plan: str, **user):
    """EngineArgs -> VllmConfig the way the engine builds it, with the plan applied first."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = tiny_llm_kwargs(model_dir, **user)
    disagg = {"nanoflow": {"nano_batches": "auto", "plan": plan}}
    args = EngineArgs(**kwargs, additional_config={"disagg": disagg})
    applied = apply_discrete_batching(args, parse_disagg_config(disagg))
    return applied, args.create_engine_config()


def test_an_engine_with_a_plan_gets_the_plans_dense_batch_as_its_token_budget(tiny_model_dir, tmp_path):
    applied, config = _engine_config(tiny_model_dir, _plan(tmp_path, 96))
    assert applied == 96
    assert config.scheduler_config.max_num_batched_tokens == 96
    assert config.scheduler_config.max_num_seqs <= 96


def test_an_explicit_user_token_budget_wins_over_the_plan(tiny_model_dir, tmp_path):
    applied, config = _engine_config(tiny_model_dir, _plan(tmp_path, 96), max_num_batched_tokens=160)
    assert applied is None
    assert config.scheduler_config.max_num_batched_tokens == 160


def test_an_explicit_larger_max_num_seqs_raises_the_budget_to_it(tiny_model_dir, tmp_path):
    applied, config = _engine_config(tiny_model_dir, _plan(tmp_path, 96), max_num_seqs=128)
    assert applied == 128
    assert config.scheduler_config.max_num_batched_tokens == 128


@pytest.mark.parametrize("nanoflow", [None, {"nano_batches": 2}])
def test_no_plan_or_no_nanoflow_leaves_vllms_default(nanoflow):
    class Args:
        model = "m"
        max_num_batched_tokens = None
        max_num_seqs = None

    cfg = parse_disagg_config({"nanoflow": nanoflow} if nanoflow else {})
    assert apply_discrete_batching(Args(), cfg) is None
    assert Args.max_num_batched_tokens is None


def test_a_plan_without_a_dense_size_leaves_vllms_default(tmp_path):
    class Args:
        model = "m"
        max_num_batched_tokens = None
        max_num_seqs = None

    cfg = parse_disagg_config({"nanoflow": {"nano_batches": "auto", "plan": _plan(tmp_path, None)}})
    assert apply_discrete_batching(Args(), cfg) is None


def test_the_plugin_wiring_applies_the_plan_when_the_engine_config_is_built(tiny_model_dir, tmp_path):
    """Through P3 (`EngineArgs.create_engine_config`), as `vllm serve` and `LLM()` build engines."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_disagg

    vllm_disagg.register()
    disagg = {"nanoflow": {"nano_batches": "auto", "plan": _plan(tmp_path, 96)}}
    args = EngineArgs(**tiny_llm_kwargs(tiny_model_dir), additional_config={"disagg": disagg})
    config = args.create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 96
