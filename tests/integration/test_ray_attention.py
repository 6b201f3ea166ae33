# SPDX-License-Identifier: Apache-2.0
"""Lamina on Ray: `vllm-disagg up --backend ray --prefill 0 --decode 0 --attention 2`, for real.

One Ray node (in a loopback-only netns, `ray_cluster.RayTestCluster`) with resource `attention: 2`:
two attention-server actors (`vllm-disagg attn-server`, fixed ports) and one model-worker actor
(`vllm serve --plugin disagg --disagg-attention-servers ...`, head-wise partition, tcp per-layer
exchange) that holds no KV cache. Checks: concurrent requests through the router, one of them
streamed, multi-block prompts, greedy float32 token ids equal to plain vLLM's; `vllm-disagg status`
lists both attention actors, healthy, each with the model worker's one session (so the worker really
computes attention on them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_cluster import RayTestCluster, prereqs
from test_ray import make_model, prompts, reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="pip install 'ray[default]'")

VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
             "--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "16", "--seed", "0"]
MAX_TOKENS = 16
PROMPTS = prompts(1, 40, 3) + prompts(1, 100, 4) + prompts(2, 300, 5)  # 2 .. 10 blocks of 32
STREAMED = [False, False, True, False]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("ray-attn-model") / "model")


@pytest.fixture(scope="module")
def lamina(model_dir):
    """(cluster, plain vLLM's ids): the reference runs while the cluster comes up."""
    if reason := prereqs():
        pytest.skip(reason)
    cluster = RayTestCluster([(3, {"attention": 2})],
                             ["--prefill", "0", "--decode", "0", "--attention", "2", "--attention-partition", "head",
                              "--model", str(model_dir), *VLLM_ARGS], up_timeout_s=600)
    try:
        cluster.start()
        expected = reference_ids(model_dir, PROMPTS, MAX_TOKENS, max_model_len=1024)
        try:
            cluster.wait_ready()
        except AssertionError as err:
            pytest.fail(str(err))
        yield cluster, expected
    finally:
        cluster.destroy()


def test_the_model_worker_and_two_attention_servers_are_actors_on_the_ray_node(lamina):
    cluster, _ = lamina
    roles = {i["name"]: i["role"] for i in cluster.state["instances"]}
    assert roles == {"vllm-disagg:attention0": "attention", "vllm-disagg:attention1": "attention",
                     "vllm-disagg:mixed0": "mixed"}
    assert all(i["node_ip"] == "127.0.0.1" and i["up"] for i in cluster.state["instances"])


def test_concurrent_requests_one_streamed_match_plain_vllm_token_for_token(lamina):
    cluster, expected = lamina
    results = cluster.complete(PROMPTS, MAX_TOKENS, stream=STREAMED)
    assert [r["status"] for r in results] == [200] * len(PROMPTS), results
    assert [r["ids"] for r in results] == expected
    assert results[2]["events"] >= MAX_TOKENS  # it really streamed, token by token


def test_status_shows_both_attention_actors_healthy_serving_the_model_worker(lamina):
    status = lamina[0].status()
    assert status["router"]["healthy"] is True
    attention = sorted(status["pools"]["attention"], key=lambda i: i["actor"])
    assert [i["actor"] for i in attention] == ["vllm-disagg:attention0", "vllm-disagg:attention1"]
    for inst in attention:
        assert inst["healthy"] is True and inst["actor_up"] is True
        assert inst["disagg_attention_sessions"] == 1.0  # the model worker's session
    (worker,) = status["pools"]["mixed"]
    assert worker["healthy"] is True and worker["actor"] == "vllm-disagg:mixed0"
