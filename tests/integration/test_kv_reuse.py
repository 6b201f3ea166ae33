# SPDX-License-Identifier: Apache-2.0
"""A new model worker reuses the KV its attention servers kept from the previous one (issue 4).

Head-wise attention servers (subprocesses) outlive in-process engines that run as `vllm-disagg up`
runs a model worker (`DisaggAttentionWorker` + `DisaggConnector`). Engine A (on the nano-batch
executor with n=2 pipelining) generates for multi-block prompts and is shut down; engine B (the stock
runner) gets each prompt + A's tokens, which is what the router replays after a model-worker restart.
B restores the full blocks from the servers instead of prefilling them, and its greedy tokens equal
plain vLLM's (float32, seeded weights: a stale or misplaced block would change them). Engine C has
looked the keys up when server 1 dies and a fresh one replaces it: the restore fails there, the
step's server loss is recovered (attention/recovery.py), vLLM recomputes the blocks that were
reported failed, and the tokens are still exact. Request-wise, each request's chain is on the one
server it lived on, and the restored request is placed there.
"""

from __future__ import annotations

import gc
import os
import urllib.request

import pytest

from vllm_disagg.testing import tiny_llm_kwargs, token_prompts

pytestmark = pytest.mark.slow
os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "test-token")
WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"
CONNECTOR = {"kv_connector": "DisaggConnector", "kv_connector_module_path": "vllm_disagg.kv.connector",
             "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
BS = 32
# A's prompts, decoded concurrently; replayed length L = prompt + FIRST tokens. All of A's requests end in
# the same step, so the blocks their last step filled are never sent to the servers: with (L - 1) % 32 != 0
# none did, and B can restore every full block of L - 1 tokens (vLLM computes at least the last token).
PROMPTS = [p["prompt_token_ids"] for p in token_prompts(2, 70, seed=11) + token_prompts(1, 100, seed=12)
           + token_prompts(1, 50, seed=13)]
FIRST, THEN = 20, 12


def _engine(model_dir, servers=None, pipeline: int = 1, partition: str = "head", **over):
    from vllm import LLM

    extra = {}
    if servers is not None:
        remote = {"servers": [s.http for s in servers], "partition": partition}
        disagg = {"remote_attention": remote}
        worker = WORKER
        if pipeline == 2:
            remote.update(pipeline=2, send_q_early=False)
            disagg["nanoflow"] = {"nano_batches": 2}
            worker = "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"
        extra = dict(worker_cls=worker, kv_transfer_config=CONNECTOR, additional_config={"disagg": disagg})
    return LLM(**tiny_llm_kwargs(model_dir, **extra, **over))


def _generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://{server.http}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def _restored(servers) -> list[float]:
    return [_metric(s, "vllm:disagg_attention_restored_blocks_total") for s in servers]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    """Plain vLLM: A's tokens, then the replayed prompts' tokens."""
    llm = _engine(tiny_model_dir)
    try:
        first, _ = _generate(llm, PROMPTS, FIRST)
        replayed = [p + g for p, g in zip(PROMPTS, first)]
        then, _ = _generate(llm, replayed, THEN)
        return first, replayed, then
    finally:
        _close(llm)


@pytest.fixture(scope="module")
def servers():
    from vllm_disagg.testing.attention import start_local_servers

    srv = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    yield srv  # a test may replace one (the list is updated)
    for s in srv:  # all at once: each takes seconds to exit
        s.proc.terminate()
    for s in srv:
        s.stop()


def test_a_new_model_worker_restores_the_blocks_its_attention_servers_kept_and_matches_plain_vllm(
        tiny_model_dir, plain, servers):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_disagg.attention import backend
    from vllm_disagg.testing.attention import start_local_server

    first, replayed, then = plain
    assert all((len(r) - 1) % BS for r in replayed)  # see PROMPTS
    expected = [(len(r) - 1) // BS for r in replayed]
    pair = list(servers)
    llm = _engine(tiny_model_dir, pair, pipeline=2)  # STEP (1) engine A registers full blocks as it goes
    try:
        assert _generate(llm, PROMPTS, FIRST)[0] == first
    finally:
        _close(llm)
    assert _restored(pair) == [0, 0]
    llm = _engine(tiny_model_dir, pair)  # STEP (2) engine B, same servers: restores, computes the tail
    try:
        got, cached = _generate(llm, replayed, THEN)
    finally:
        _close(llm)
    assert got == then
    assert cached == [n * BS for n in expected]  # vLLM counted them as computed: prefill work saved
    assert _restored(pair) == [sum(expected)] * 2  # head-wise: every server restored its slice
    assert [_metric(s, "vllm:disagg_attention_restore_misses_total") for s in pair] == [0, 0]

    llm = _engine(tiny_model_dir, pair)  # STEP (3) engine C looked up the same 9 blocks on both servers ...
    try:
        port = int(servers[1].http.rsplit(":", 1)[1])
        servers[1].kill()  # ... then server 1 dies and a fresh one (nothing retained) takes its address
        servers[1] = start_local_server(transport="shm", kv_cache_gib=0.0625, http_port=port)
        got, cached = _generate(llm, replayed, THEN)
        reuse = get_kv_transfer_group().connector_worker.reuse
        assert (reuse.num_restored_blocks, reuse.num_failed_blocks) == (0, sum(expected))  # all recomputed
        assert backend.get_client().num_recoveries == 1  # the step found server 1 gone and rebuilt the KV
    finally:
        _close(llm)
    assert got == then


def test_request_wise_a_restored_request_goes_to_the_server_that_kept_its_blocks(tiny_model_dir, plain, servers):
    first, replayed, then = plain
    expected = [(len(r) - 1) // BS for r in replayed]
    pair = servers  # request-wise geometry (all heads) differs from head-wise: both start empty
    before = _restored(pair)
    llm = _engine(tiny_model_dir, pair, partition="request")  # STEP (1) engine D spreads the requests
    try:
        assert _generate(llm, PROMPTS, FIRST)[0] == first
    finally:
        _close(llm)
    llm = _engine(tiny_model_dir, pair, partition="request")  # STEP (2) engine E restores them
    try:
        got, cached = _generate(llm, replayed, THEN)
    finally:
        _close(llm)
    assert got == then and cached == [n * BS for n in expected]
    restored = [a - b for a, b in zip(_restored(pair), before)]
    assert sum(restored) == sum(expected) and all(restored)  # each block on the one server it lived on


def test_after_an_attention_server_is_replaced_vllms_prefix_cache_no_longer_serves_the_chains_it_held(
        tiny_model_dir, plain, servers):
    """Found by benchmarks/chaos.py (wrong tokens after an attention server restart): the recovery
    rebuilds the running requests' KV, but vLLM's prefix cache still listed the finished requests'
    chains, whose KV was half on the lost server. A prompt that hit such a chain read what the fresh
    server held. The scheduler now empties the prefix cache when the worker reports a recovery."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_disagg.attention import backend
    from vllm_disagg.testing.attention import start_local_server

    first, _, _ = plain
    llm = _engine(tiny_model_dir, list(servers), enable_prefix_caching=True)
    try:
        assert _generate(llm, PROMPTS[:1], FIRST)[0] == first[:1]  # its 2 full blocks stay cached in vLLM
        port = int(servers[1].http.rsplit(":", 1)[1])
        servers[1].kill()
        servers[1] = start_local_server(transport="shm", kv_cache_gib=0.0625, http_port=port)
        assert _generate(llm, PROMPTS[3:4], FIRST)[0] == first[3:4]  # this step finds the fresh server, recovers
        assert backend.get_client().num_recoveries == 1
        got, cached = _generate(llm, PROMPTS[:1], FIRST)  # the first prompt again: its cached chain is gone
        assert got == first[:1]
        assert get_kv_transfer_group().connector_worker.reuse.num_restored_blocks == 0
    finally:
        _close(llm)
