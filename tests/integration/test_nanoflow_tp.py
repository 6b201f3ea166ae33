# SPDX-License-Identifier: Apache-2.0
"""Nano-batching with TP=2 (gloo, two worker processes): all-reduce runs as its own op on the
"net" unit thread, and greedy output still equals plain TP=2 vLLM token for token.

Expensive here (each TP=2 engine starts in 1-2 min on 2 shared cores), hence one request mix and
two engines.
"""

from __future__ import annotations

import gc
import os

import pytest

from vllm_disagg.testing import tiny_llm_kwargs, token_prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 binds one core per rank"),
]

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _generate(model_dir: str, **extra) -> tuple[list, list | None]:
    from vllm import LLM, SamplingParams

    llm = LLM(**tiny_llm_kwargs(model_dir, tensor_parallel_size=2, max_num_batched_tokens=96, **extra))
    try:
        prompts = token_prompts(2, 150, seed=7) + token_prompts(5, 40, seed=8)
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        stats = llm.collective_rpc("nanoflow_stats") if "worker_cls" in extra else None
        return [list(o.outputs[0].token_ids) for o in outs], stats
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def tp_runs(tiny_model_dir):
    saved = {k: os.environ.get(k) for k in TP_ENV}
    os.environ.update(TP_ENV)
    try:
        plain, _ = _generate(tiny_model_dir)
        nano, stats = _generate(
            tiny_model_dir,
            worker_cls="vllm_disagg.nanoflow.worker.NanoFlowCPUWorker",
            additional_config={"disagg": {"nanoflow": {"nano_batches": 4}}},
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return plain, nano, stats


def test_tp2_with_four_nano_batches_and_all_reduce_on_the_network_unit_matches_plain_tp2(tp_runs):
    plain, nano, stats = tp_runs
    assert nano == plain
    assert len(stats) == 2
    for rank_stats in stats:
        assert rank_stats["pipeline_steps"] > 0 and rank_stats["fallback_steps"] == 0
        assert rank_stats["inline"] is False
        assert "net" in {u["name"] for u in rank_stats["units"]}
        assert rank_stats["mixed_steps"] > 0
