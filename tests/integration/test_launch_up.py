# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --prefill 0 --decode 0` (the `make demo` path): one plain vLLM behind the router.

Checks the launcher itself: readiness, unknown arguments reaching vLLM, and a clean SIGTERM shutdown
that leaves no process of the deployment behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_up_serves_one_plain_instance_passes_vllm_args_and_stops_cleanly(tiny_model_dir, tmp_path):
    state_file = tmp_path / "state.json"
    cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--prefill", "0", "--decode", "0",
           "--model", tiny_model_dir, "--port", "0", "--state-file", str(state_file),
           "--log-dir", str(tmp_path / "logs"), "--load-format", "dummy", "--skip-tokenizer-init",
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(1)
        state = json.loads(state_file.read_text())
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
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert b"ready. OpenAI endpoint" in proc.stdout.read()
        deadline = time.monotonic() + 10  # SIGKILLed members vanish once init reaps them
        while _alive(inst["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(inst["pid"]), "the vLLM instance's process group outlived `up`"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
