# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg tune` profiles the tiny model on this CPU and writes a plan the executor loads."""

from __future__ import annotations

import json

from vllm_disagg.cli.main import main
from vllm_disagg.nanoflow.plan import NanoFlowPlan
from vllm_disagg.nanoflow.profiler import ModelShape


def test_tune_writes_a_loadable_plan_with_a_fast_dense_batch(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        ["tune", "--model", tiny_model_dir, "--quick", "--max-tokens", "32", "--reps", "1", "--out", str(out)]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plan = NanoFlowPlan.load(out)
    assert summary["plan"] == str(out)
    assert plan.dense_batch_size in plan.fast_sizes
    assert plan.nano_batches.attn % plan.nano_batches.dense == 0
    assert set(plan.op_cost_s) == {"kqv", "attn", "o", "ugd"}
    assert plan.peak_flops and plan.peak_flops > 0
    assert plan.threaded == bool(plan.units)


def test_model_shape_reads_a_hf_config(tiny_model_dir):
    shape = ModelShape.from_hf_config(tiny_model_dir)
    assert (shape.hidden, shape.q_size, shape.kv_size, shape.num_layers) == (128, 128, 64, 2)
