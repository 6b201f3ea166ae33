# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --prefill 1 --decode 1 --tensor-parallel-size 2`: P/D at TP=2 the way users start it.

Opt-in (`VD_TEST_UP_TP=1`): two TP=2 engines cost 1-3 min here, and test_pd_tp.py already runs the
connector at TP=2 in CI; this one checks what `up` adds: a run of free KV ports per instance (rank r
serves on kv_port + r), one core list per rank, the router handing out rank 0's address only.
Greedy float32 tokens through the router equal the decode engine's own output (plain vLLM at TP=2).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import urllib.request
from pathlib import Path

import pytest

from vllm_disagg.testing import running_up

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("VD_TEST_UP_TP") != "1", reason="opt-in: VD_TEST_UP_TP=1 (two TP=2 engines)"),
]

ENGINE_ARGS = ["--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
               "--block-size", "32", "--no-enable-prefix-caching", "--seed", "0"]
# one layer-wise push (>= 256 tokens, partial last block) and one serialized
PROMPTS = [[(11 * i + 5 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((300, 45))]
MAX_TOKENS = 6


def _complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["choices"][0]["token_ids"]


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_up_runs_prefill_and_decode_at_tp2_and_matches_plain_vllm(tiny_model_dir, tmp_path):
    with running_up(tmp_path, "--prefill", "1", "--decode", "1", "--model", tiny_model_dir,
                    "--tensor-parallel-size", "2", *ENGINE_ARGS) as up:
        state = up.state
        prefill, decode = state["instances"]
        assert (prefill["role"], decode["role"]) == ("prefill", "decode")
        for inst in (prefill, decode):  # each rank got its own core list
            assert len(inst["cores"].split("|")) == 2, inst
        host, port = prefill["kv"].rsplit(":", 1)
        with socket.create_connection((host, int(port) + 1), timeout=10):
            pass  # P's rank 1 serves its side channel on kv_port + 1
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(state["endpoint"], state["model"], p), PROMPTS))
        plain = [_complete(decode["url"], state["model"], p) for p in PROMPTS]  # no kv_transfer_params
        assert got == plain, "P/D at TP=2 through the router gave other tokens than plain vLLM at TP=2"
        assert _metric(prefill["url"], "vllm:disagg_kv_bytes_pushed_total") > 0
        assert _metric(decode["url"], "vllm:disagg_kv_fallbacks_total") == 0
    log = (Path(tmp_path) / "logs" / "decode0.log").read_text(errors="replace")
    assert "recomputes the prompt" not in log, "a push failed; see the decode log"
