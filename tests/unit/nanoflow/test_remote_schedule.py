# SPDX-License-Identifier: Apache-2.0
"""The step schedule with remote attention (on the "net" unit) is the ping-pong order."""

from types import SimpleNamespace

from vllm_disagg.nanoflow.graph import NET, PipelineSpec
from vllm_disagg.nanoflow.runner import NanoFlowRunnerMixin

# FLOP-proportional per-token costs of the medium bench Llama (hidden 512, MLP 1536, GQA 8/4 x 64)
PER_TOKEN = {"kqv": 512 * 1024, "attn": 4 * 512 * 64, "o": 512 * 512, "ugd": 3 * 512 * 1536}


def _schedule(attn_unit: str):
    runner = SimpleNamespace(
        _nano_schedules={},
        nano_plan=SimpleNamespace(op_cost_s={}),
        nano_pipeline=SimpleNamespace(relative_cost=lambda name, tokens: float(PER_TOKEN[name] * tokens)),
        nano_executor=SimpleNamespace(exclusive_units=frozenset({"dense"})),
    )
    spec = PipelineSpec(num_layers=3, num_attn_batches=2, num_dense_batches=2, attn_unit=attn_unit)
    _, schedule = NanoFlowRunnerMixin._nano_schedule(runner, spec, 32)
    return [f"{name}{layer}.{nb}" for name, layer, nb in schedule.order["dense"]]


def test_remote_attention_issues_each_nano_batchs_next_kqv_before_the_other_nano_batchs_dense_ops():
    dense = _schedule(NET)
    for layer in range(2):
        # nano-batch 0's next layer starts (and its attention RPC goes out) while nano-batch 1's
        # o/ugd run, so the net unit never idles behind them
        assert dense.index(f"kqv{layer + 1}.0") < dense.index(f"o{layer}.1")
        assert dense.index(f"ugd{layer}.0") < dense.index(f"kqv{layer + 1}.0")
