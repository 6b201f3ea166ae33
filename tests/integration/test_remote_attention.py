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


def _generate(model_dir, remote=None, prompts=PROMPTS, preemptions=None, **over):
    from vllm import LLM, SamplingParams

    extra = {}
    if remote is not None:
        extra = dict(worker_cls=WORKER, additional_config={"disagg": {"remote_attention": remote}})
    llm = LLM(**tiny_llm_kwargs(model_dir, **{**extra, **over}))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if preemptions is not None:  # needs disable_log_stats=False
            preemptions.append(sum(o.metrics.num_preemptions for o in outs))
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


def _messages(server) -> dict:
    """Messages a server handled so far, by type, from its Prometheus /metrics."""
    import urllib.request
    from collections import defaultdict

    with urllib.request.urlopen(f"http://{server.http}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    out: dict = defaultdict(float)
    for line in lines:
        if line.startswith("vllm:disagg_attention_messages_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


@pytest.fixture(scope="module")
def servers():
    from vllm_disagg.testing.attention import start_local_servers

    srv = start_local_servers(4, transport="shm", kv_cache_gib=0.0625)
    yield srv
    for s in srv:
        s.stop()


@pytest.fixture(scope="module")
def kv4_model_dir(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-kv4"), weights=True, num_key_value_heads=4))


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
    before = [_messages(s) for s in servers[:num_servers]]
    _assert_same(_generate(tiny_model_dir, remote), plain)
    kind = "QPREV" if send_q_early else "ATTN"  # the servers really did the attention
    assert all(_messages(s)[kind] > b[kind] for s, b in zip(servers[:num_servers], before))


@pytest.mark.parametrize("partition", ["head", "request"])
def test_four_attention_servers_match_plain_vllm_on_a_four_kv_head_model(kv4_model_dir, plain_kv4, servers,
                                                                         partition):
    remote = {"servers": [s.http for s in servers], "partition": partition, "send_q_early": True}
    _assert_same(_generate(kv4_model_dir, remote), plain_kv4)


def test_preemption_under_a_small_remote_kv_pool_still_matches_plain_vllm(tiny_model_dir, servers):
    # Six one-block prompts all start; each needs a second block at its first decode step, and
    # only 7 blocks are usable (block 0 is vLLM's null block): the scheduler must preempt some.
    small = dict(num_gpu_blocks_override=8, max_model_len=128, disable_log_stats=False,
                 prompts=token_prompts(6, 32, seed=5))
    counts: list[int] = []
    plain_small = _generate(tiny_model_dir, preemptions=counts, **small)
    remote = {"servers": [s.http for s in servers[:2]], "partition": "request", "send_q_early": True}
    _assert_same(_generate(tiny_model_dir, remote, preemptions=counts, **small), plain_small)
    assert counts[0] > 0 and counts[1] > 0


def test_n2_pipelining_on_the_nano_batch_executor_matches_plain_vllm(tiny_model_dir, plain, servers):
    remote = {"servers": [s.http for s in servers[:2]], "partition": "head", "send_q_early": False, "pipeline": 2}
    got = _generate(tiny_model_dir, remote, worker_cls="vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker",
                    additional_config={"disagg": {"remote_attention": remote, "nanoflow": {"num_nano_batches": 2}}})
    _assert_same(got, plain)


@pytest.mark.parametrize("partition", ["head", "request"])
def test_killing_an_attention_server_mid_decode_loses_no_request(tiny_model_dir, plain, partition):
    from vllm import LLM, SamplingParams

    from vllm_disagg.testing.attention import start_local_servers

    own = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    remote = {"servers": [s.http for s in own], "partition": partition, "timeout_s": 10.0}
    # headroom: after the loss one server holds all heads, so half the blocks it held before
    llm = LLM(**tiny_llm_kwargs(tiny_model_dir, worker_cls=WORKER, num_gpu_blocks_override=256,
                                additional_config={"disagg": {"remote_attention": remote}}))
    try:
        engine = llm.llm_engine
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, sp)
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id)] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 4:  # mid-decode: every request has KV on both servers
                own[1].kill()
        assert [done[i] for i in range(len(PROMPTS))] == [toks for toks, _ in plain]
        from vllm_disagg.attention import backend  # the worker runs in this process here

        client = backend.get_client()
        assert client.num_recoveries == 1 and [c.http_addr for c in client.conns] == [own[0].http]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        for s in own:
            s.stop()


def _prefix_waves(model_dir, remote=None) -> tuple[list, list[int], int]:
    """Two waves through one engine with prefix caching on: the second wave's prompts start with the
    first wave's (2-3 full blocks cached). Returns tokens, cached tokens per request, affinity count."""
    from vllm import LLM, SamplingParams

    extra = {} if remote is None else dict(worker_cls=WORKER, additional_config={"disagg": {"remote_attention": remote}})
    llm = LLM(**tiny_llm_kwargs(model_dir, enable_prefix_caching=True, **extra))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    heads = [p["prompt_token_ids"] for p in token_prompts(2, 80, seed=11)]
    tails = [p["prompt_token_ids"] for p in token_prompts(5, 9, seed=12)]
    waves = [[heads[0] + tails[0], heads[1] + tails[1]], [heads[1] + tails[2], heads[0] + tails[3], heads[0] + tails[4]]]
    try:
        tokens, cached = [], []
        for wave in waves:
            outs = llm.generate([{"prompt_token_ids": p} for p in wave], sp, use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
            cached += [o.num_cached_tokens or 0 for o in outs]
        affinity = 0
        if remote is not None:
            from vllm_disagg.attention import backend  # the worker runs in this process here

            affinity = backend.get_client().placer.num_prefix_affinity
        return tokens, cached, affinity
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def test_request_wise_with_prefix_caching_places_cached_prefixes_on_their_server(tiny_model_dir, servers):
    """partition auto on 3 servers and a 2-KV-head model is request-wise; vLLM's prefix caching stays
    on: a request starting on cached blocks goes to the server holding them and matches plain vLLM."""
    plain_tokens, plain_cached, _ = _prefix_waves(tiny_model_dir)
    remote = {"servers": [s.http for s in servers[:3]]}  # 3 servers, tiny model's 2 KV heads: auto = request
    tokens, cached, affinity = _prefix_waves(tiny_model_dir, remote)
    assert tokens == plain_tokens
    assert cached[2:] == plain_cached[2:] and all(c >= 64 for c in cached[2:])  # the second wave hit the cache
    assert affinity >= 3  # (two running requests on one cached chain count again at later steps)


def _window_schedule(model_dir, remote=None, kill=None) -> tuple[dict, list[int], list[int], int]:
    """X (short), A (long: vLLM frees its out-of-window blocks after the prefill), then B, which gets
    some of them; X finishes, so B moves ahead of A in the batch, and `kill()` runs at the next step.
    Returns the tokens by request, A's first-step blocks and B's in the first KV cache group, and the
    number of recoveries."""
    from vllm import LLM, SamplingParams

    extra = {} if remote is None else dict(worker_cls=WORKER, additional_config={"disagg": {"remote_attention": remote}})
    llm = LLM(**tiny_llm_kwargs(model_dir, num_gpu_blocks_override=24, max_model_len=320, **extra))
    engine = llm.llm_engine
    manager = engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    prompts = dict(zip("XAB", (p["prompt_token_ids"] for p in
                               token_prompts(1, 20, seed=1) + token_prompts(1, 230, seed=2) + token_prompts(1, 130, seed=3))))
    blocks: dict[str, list[int]] = {}
    try:
        for name, max_tokens in (("X", 6), ("A", 30)):
            engine.add_request(name, {"prompt_token_ids": prompts[name]}, SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True))
        done, steps, killed = {}, 0, False
        while engine.has_unfinished_requests():
            if steps == 2:
                engine.add_request("B", {"prompt_token_ids": prompts["B"]}, SamplingParams(
                    max_tokens=30, temperature=0, ignore_eos=True))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            for rid, held in manager.req_to_blocks.items():
                blocks.setdefault(rid.split("-")[0], [b.block_id for b in held])
            if kill is not None and "X" in done and not killed:
                kill()
                killed = True
        from vllm_disagg.attention import backend  # the worker runs in this process here

        return done, blocks["A"], blocks["B"], 0 if remote is None else backend.get_client().num_recoveries
    finally:
        engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_recovery_on_a_windowed_model_never_writes_into_another_requests_blocks(tmp_path, family):
    """The recovery recomputes every running request's whole sequence through the worker's block table.
    vLLM frees a running request's out-of-window blocks (its scheduler's table gets the null block, the
    worker's keeps the ids) and gives them to later requests: A's rebuild wrote into B's window blocks,
    and B's tokens changed after an attention server died (Gemma 2 with vLLM's hybrid allocator,
    head-wise; Mistral with any). The runner allocates windows in full (attention/worker.py)."""
    from vllm_disagg.testing import make_tiny_model
    from vllm_disagg.testing.attention import start_local_servers

    model_dir = str(make_tiny_model(family, tmp_path / family))
    plain, plain_a, plain_b, _ = _window_schedule(model_dir)
    assert set(plain_b) & set(plain_a[:4]), (plain_a, plain_b)  # plain vLLM gave B blocks A had held
    own = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    try:
        remote = {"servers": [s.http for s in own], "partition": "head", "timeout_s": 10.0}
        got, remote_a, remote_b, num_recoveries = _window_schedule(model_dir, remote, kill=own[1].kill)
    finally:
        for s in own:
            s.stop()
    assert num_recoveries == 1 and got == plain
    assert not set(remote_b) & set(remote_a), (remote_a, remote_b)  # windows held in full: nothing reused
