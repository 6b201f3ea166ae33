# SPDX-License-Identifier: Apache-2.0
"""Nano-batched greedy output equals plain vLLM, token for token (real engine, float32, CPU).

One request mix covers prefill (multi-block prompts, a prompt split across nano-batches), decode
(8 concurrent requests), and mixed prefill+decode steps (chunked prefill with a small token
budget). Each engine runs once per module; tests compare the recorded outputs.
"""

from __future__ import annotations

import gc
import json

import pytest

from vllm_disagg.testing import tiny_llm_kwargs, token_prompts

pytestmark = pytest.mark.slow

WORKER = "vllm_disagg.nanoflow.worker.NanoFlowCPUWorker"
MAX_TOKENS = 10
LOGPROB_ATOL = 1e-3


def _prompts() -> list[dict]:
    lengths = [300, 100, 70, 33, 45, 64, 90, 20]
    out = []
    for i, n in enumerate(lengths):
        out += token_prompts(1, n, seed=100 + i)
    return out


def _generate(model_dir: str, **extra) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(**tiny_llm_kwargs(model_dir, max_num_batched_tokens=128, max_num_seqs=16, **extra))
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
        ]
        stats = llm.collective_rpc("nanoflow_stats")[0] if "worker_cls" in extra else None
        return {"tokens": tokens, "logprobs": logprobs, "stats": stats}
    finally:
        del llm
        gc.collect()


def _nano(model_dir: str, nanoflow: dict) -> dict:
    return _generate(model_dir, worker_cls=WORKER, additional_config={"disagg": {"nanoflow": nanoflow}})


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict:
    from vllm_disagg.cli.main import main

    plans = tmp_path_factory.mktemp("plans")
    threaded = plans / "threaded.json"
    threaded.write_text(
        json.dumps({"version": 1, "nano_batches": {"attn": 4, "dense": 2}, "units": {"dense": 1, "attn": 1}})
    )
    tuned = plans / "tuned.json"
    assert (
        main(
            [
                "tune",
                "--model",
                tiny_model_dir,
                "--quick",
                "--max-tokens",
                "64",
                "--reps",
                "1",
                "--min-nano-batches",
                "2",
                "--out",
                str(tuned),
            ]
        )
        == 0
    )
    break_even = plans / "break_even.json"  # a plan whose cost model says: split only steps of >= 64 tokens
    break_even.write_text(json.dumps({"version": 1, "nano_batches": {"attn": 2, "dense": 2}, "break_even_tokens": 64}))
    return {
        "plain": _generate(tiny_model_dir),
        "auto_n1": _nano(tiny_model_dir, {"num_nano_batches": "auto"}),  # no plan, nothing to overlap on CPU
        "auto_break_even": _nano(tiny_model_dir, {"num_nano_batches": "auto", "plan": str(break_even)}),
        "nano2": _nano(tiny_model_dir, {"num_nano_batches": 2}),
        "nano4": _nano(tiny_model_dir, {"num_nano_batches": "auto", "plan": str(threaded)}),
        "tuned": _nano(tiny_model_dir, {"num_nano_batches": "auto", "plan": str(tuned)}),
    }


def _assert_same_as_plain(runs: dict, name: str) -> None:
    plain, got = runs["plain"], runs[name]
    assert got["tokens"] == plain["tokens"]
    for ref, lps in zip(plain["logprobs"], got["logprobs"]):
        assert lps == pytest.approx(ref, abs=LOGPROB_ATOL)


def _assert_really_nano_batched(stats: dict) -> None:
    assert stats["pipeline"] is True
    assert stats["pipeline_steps"] > 0 and stats["fallback_steps"] == 0
    assert stats["prefill_steps"] > 0
    assert stats["decode_steps"] > 0
    assert stats["mixed_steps"] > 0


def test_two_nano_batches_give_the_same_greedy_tokens_as_plain_vllm(runs):
    _assert_same_as_plain(runs, "nano2")
    _assert_really_nano_batched(runs["nano2"]["stats"])


def test_four_attention_and_two_dense_nano_batches_on_pinned_unit_threads_give_the_same_tokens(runs):
    _assert_same_as_plain(runs, "nano4")
    stats = runs["nano4"]["stats"]
    _assert_really_nano_batched(stats)
    assert stats["inline"] is False
    assert {u["name"] for u in stats["units"]} == {"dense", "attn"}


def test_the_plan_written_by_vllm_disagg_tune_loads_runs_and_matches(runs):
    _assert_same_as_plain(runs, "tuned")
    _assert_really_nano_batched(runs["tuned"]["stats"])


def test_auto_without_a_plan_runs_vllms_plain_forward_when_nothing_can_overlap(runs):
    _assert_same_as_plain(runs, "auto_n1")
    stats = runs["auto_n1"]["stats"]
    assert stats["nano_batching"] is False and stats["runner"] == "CPUModelRunner"  # vLLM's own runner


def test_auto_splits_only_the_steps_at_or_above_the_plans_break_even(runs):
    _assert_same_as_plain(runs, "auto_break_even")
    stats = runs["auto_break_even"]["stats"]
    assert stats["nano_batching"] is True and stats["pipeline_steps"] > 0  # the 128-token prefill steps
    assert stats["plain_steps"] > 0 and stats["decode_steps"] == 0  # 8-token decode steps ran un-split


def test_the_executor_reports_throughput_against_the_cost_model_optimum(runs):
    stats = runs["nano2"]["stats"]
    assert stats["forward_tokens_per_s"] > 0
    assert stats["optimal_tokens_per_s"] is None or 0 < stats["fraction_of_optimal"] < 1
