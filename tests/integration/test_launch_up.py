# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --prefill 0 --decode 0` (the `make demo` path): one plain vLLM behind the router.

Checks the launcher itself: readiness, unknown arguments reaching vLLM, and a clean SIGTERM shutdown
that leaves no process of the deployment behind.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import urllib.request

import pytest

from vllm_disagg.testing import running_up

pytestmark = pytest.mark.slow


def test_up_serves_one_plain_instance_passes_vllm_args_and_stops_cleanly(tiny_model_dir, tmp_path):
    with running_up(tmp_path, "--prefill", "0", "--decode", "0", "--model", tiny_model_dir,
                    "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                    "--max-model-len", "1024") as up:
        state = up.state
        [inst] = state["instances"]
        assert inst["role"] == "mixed" and inst["kv"] is None
        models = json.load(urllib.request.urlopen(f"{state['endpoint']}/v1/models", timeout=10))
        assert models["data"][0]["max_model_len"] == 1024  # an unknown arg reached vLLM
        req = urllib.request.Request(
            f"{state['endpoint']}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": state["model"], "prompt": [5, 6, 7], "max_tokens": 4,
                             "temperature": 0, "return_token_ids": True}).encode())
        out = json.load(urllib.request.urlopen(req, timeout=60))
        assert len(out["choices"][0]["token_ids"]) == 4
    assert b"ready. OpenAI endpoint" in up.output  # exited 0 on SIGTERM, nothing left behind


# ------------------------------------------------------------------ Lamina: `up --attention K`
ENGINE_ARGS = ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--block-size", "32", "--no-enable-prefix-caching", "--seed", "0"]
# multi-block prompts (block size 32) of different lengths, sent concurrently
ATTN_PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((70, 97, 33, 5))]
ATTN_MAX_TOKENS = 8


def _complete(state: dict, prompt: list[int], stream: bool) -> list[int]:
    body = {"model": state["model"], "prompt": prompt, "max_tokens": ATTN_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    req = urllib.request.Request(f"{state['endpoint']}/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"}, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as resp:
        if not stream:
            return json.load(resp)["choices"][0]["token_ids"]
        ids = []
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    ids += choice.get("token_ids") or []
        return ids


def _concurrent_then_streamed(state: dict) -> list[list[int]]:
    """All prompts at once (non-streamed), then the longest one streamed."""
    with concurrent.futures.ThreadPoolExecutor(len(ATTN_PROMPTS)) as pool:
        outs = list(pool.map(lambda p: _complete(state, p, False), ATTN_PROMPTS))
    return outs + [_complete(state, ATTN_PROMPTS[1], True)]


@pytest.fixture(scope="module")
def plain_attn_tokens(tiny_model_dir):
    """Greedy float32 tokens of plain vLLM (in process) for ATTN_PROMPTS."""
    import gc

    from vllm import LLM, SamplingParams

    from vllm_disagg.testing import tiny_llm_kwargs

    llm = LLM(**tiny_llm_kwargs(tiny_model_dir, max_model_len=1024))
    try:
        sp = SamplingParams(max_tokens=ATTN_MAX_TOKENS, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ATTN_PROMPTS], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _metrics(url: str, prefix: str) -> dict[str, float]:
    """Samples (name with labels -> value) of `url`'s /metrics whose name starts with `prefix`."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[-1]) for line in lines if line.startswith(prefix)}


def test_up_with_two_attention_servers_and_no_prefill_matches_plain_vllm_and_status_lists_them(
        tiny_model_dir, plain_attn_tokens, tmp_path):
    with running_up(tmp_path, "--prefill", "0", "--attention", "2", "--attention-partition", "head",
                    "--model", tiny_model_dir, *ENGINE_ARGS) as up:
        state, state_file = up.state, up.state_file
        roles = [i["role"] for i in state["instances"]]
        assert roles == ["attention", "attention", "mixed"]
        got = _concurrent_then_streamed(state)
        assert got == plain_attn_tokens + [plain_attn_tokens[1]]
        for inst in state["instances"][:2]:  # both head shards did attention work for the model worker
            metrics = _metrics(inst["url"], "vllm:disagg_attention")
            assert metrics["vllm:disagg_attention_sessions"] == 1
            assert metrics["vllm:disagg_attention_bytes_in_total"] > 0
        status = subprocess.run([sys.executable, "-m", "vllm_disagg.cli.main", "status", "--state-file",
                                 str(state_file)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "attention (2/2 healthy)" in status.stdout and "sessions=1" in status.stdout


# ------------------------------------------------------------------ the mixed pool: whole requests on P
def _router_counter(url: str, name: str, *labels: str) -> float:
    return sum(v for k, v in _metrics(url, name + "{").items() if all(label in k for label in labels))


def test_up_1p1d_with_the_mixed_pool_open_serves_whole_requests_on_p_with_plain_vllms_tokens(
        tiny_model_dir, plain_attn_tokens, tmp_path):
    """`--colocate-queue-s` near 0: once P's prompt rate is measured, a request that finds any prompt
    queued on P is served whole there (the router's default opens at 4 s of P's measured work)."""
    with running_up(tmp_path, "--prefill", "1", "--decode", "1", "--colocate-queue-s", "1e-6",
                    "--model", tiny_model_dir, *ENGINE_ARGS) as up:
        state = up.state
        url = state["endpoint"]
        assert _complete(state, ATTN_PROMPTS[2], False) == plain_attn_tokens[2]  # P/D: measures P's rate
        for _ in range(3):  # the prompts must overlap on P; on a busy box one round may not
            assert _concurrent_then_streamed(state) == plain_attn_tokens + [plain_attn_tokens[1]]
            if _router_counter(url, "vllm:disagg_router_whole_requests_total", 'pool="prefill"') >= 1:
                break
        assert _router_counter(url, "vllm:disagg_router_whole_requests_total", 'pool="prefill"') >= 1
        assert _router_counter(url, "vllm:disagg_router_requests_total", 'route="pd"', 'outcome="ok"') >= 1
