# SPDX-License-Identifier: Apache-2.0
"""Remote attention (Lamina) on the nano-batch executor: at pipeline depth 2 the attention ops run on
the "net" unit while the other nano-batch's dense ops run; at depth 1 the same nano-batches run
serially (the benchmark's baseline). Greedy output equals plain vLLM token for token in both."""

from __future__ import annotations

import gc
import os

import pytest

from vllm_disagg.testing import tiny_llm_kwargs, token_prompts

pytestmark = pytest.mark.slow
os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "test-token")
PROMPTS = token_prompts(2, 120, seed=11) + token_prompts(6, 40, seed=12)


def _generate(model_dir: str, **extra):
    from vllm import LLM, SamplingParams

    llm = LLM(**tiny_llm_kwargs(model_dir, max_num_batched_tokens=128, **extra))
    try:
        sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        stats = llm.collective_rpc("nanoflow_stats")[0] if "worker_cls" in extra else None
        got = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        return got, stats
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    from vllm_disagg.attention.launcher import start_local_servers

    plain, _ = _generate(tiny_model_dir)
    servers = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    try:
        runs = {}
        for depth in (None, 1):  # None: the worker's default (ping-pong)
            ra = {"servers": [s.http for s in servers]}
            if depth is not None:
                ra.update(pipeline=depth, spin_us=50.0)
            runs[depth] = _generate(
                tiny_model_dir,
                worker_cls="vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker",
                additional_config={"disagg": {"remote_attention": ra, "nanoflow": {"nano_batches": 2}}},
            )
    finally:
        for s in servers:
            s.stop()
    (nano, stats), serial = runs[None], runs[1]
    return plain, nano, stats, serial


def _assert_same(got, plain) -> None:
    for (toks, lps), (ref_toks, ref_lps) in zip(got, plain):
        assert toks == ref_toks
        for step, ref_step in zip(lps, ref_lps):
            for tok, lp in ref_step.items():
                assert step[tok].logprob == pytest.approx(lp.logprob, abs=1e-3)


def test_two_nano_batches_in_flight_on_remote_attention_match_plain_vllm(runs):
    plain, nano, _, _ = runs
    _assert_same(nano, plain)


def test_pipeline_depth_one_runs_the_same_nano_batches_serially_and_matches_plain_vllm(runs):
    plain, _, _, (serial, stats) = runs
    _assert_same(serial, plain)
    assert stats["pipeline_steps"] > 0 and stats["decode_steps"] > 0
    assert stats["inline"] is True  # nothing overlaps: one batch in flight
    assert {u["name"] for u in stats["units"]} == {"dense"}


def test_remote_attention_ops_run_on_the_network_unit_thread(runs):
    _, _, stats, _ = runs
    assert stats["pipeline_steps"] > 0 and stats["fallback_steps"] == 0
    assert stats["inline"] is False
    assert {u["name"] for u in stats["units"]} == {"dense", "net"}
    assert stats["decode_steps"] > 0 and stats["mixed_steps"] > 0
