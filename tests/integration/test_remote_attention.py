# SPDX-License-Identifier: Apache-2.0
"""Remote attention (Lamina) end to end: a real vLLM engine whose attention runs on attention
servers (separate processes, shm transport) gives the same greedy tokens as plain vLLM."""

from __future__ import annotations

import gc
import os

import pytest

from vllm_disagg.testing import make_tiny_llama, tiny_llm_kwargs, token_prompts

pytestmark = pytest.mark.slow
os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "test-token")
WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"
# multi-block prompts of different lengths, decoded concurrently
PROMPTS = token_prompts(3, 70, seed=1) + token_prompts(2, 33, seed=2) + token_prompts(1, 5, seed=3)
MAX_TOKENS = 10


def _generate(model_dir, remote=None, **over):
    from vllm import LLM, SamplingParams

    extra = {}
    if remote is not None:
        extra = dict(worker_cls=WORKER, additional_config={"disagg": {"remote_attention": remote}})
    llm = LLM(**tiny_llm_kwargs(model_dir, **extra, **over))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    try:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _assert_same(got, want):
    for (toks, lps), (ref_toks, ref_lps) in zip(got, want):
        assert toks == ref_toks
        for step, ref_step in zip(lps, ref_lps):  # attention exactness shows in the logprobs
            for tok, lp in ref_step.items():
                assert step[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.fixture(scope="module")
def servers():
    from vllm_disagg.attention.launcher import start_local_servers

    srv = start_local_servers(4, transport="shm", kv_cache_gib=0.0625)
    yield srv
    for s in srv:
        s.stop()


@pytest.fixture(scope="module")
def kv4_model_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-kv4"), num_key_value_heads=4))


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return _generate(tiny_model_dir)


@pytest.fixture(scope="module")
def plain_kv4(kv4_model_dir):
    return _generate(kv4_model_dir)


@pytest.mark.parametrize(
    ("num_servers", "partition", "send_q_early"),
    [(1, "head", False), (2, "head", True), (2, "request", True), (2, "request", False)],
)
def test_remote_attention_gives_plain_vllms_greedy_tokens(tiny_model_dir, plain, servers, num_servers,
                                                          partition, send_q_early):
    remote = {"servers": [s.http for s in servers[:num_servers]], "partition": partition,
              "send_q_early": send_q_early}
    _assert_same(_generate(tiny_model_dir, remote), plain)


@pytest.mark.parametrize("partition", ["head", "request"])
def test_four_attention_servers_match_plain_vllm_on_a_four_kv_head_model(kv4_model_dir, plain_kv4, servers,
                                                                         partition):
    remote = {"servers": [s.http for s in servers], "partition": partition, "send_q_early": True}
    _assert_same(_generate(kv4_model_dir, remote), plain_kv4)
