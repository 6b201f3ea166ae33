# SPDX-License-Identifier: Apache-2.0
"""The `vllm` and `vllm-disagg` command lines in the venv: version, help, errors, and a real serve."""

import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vllm_disagg.launch.local import free_ports

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def run(*argv, timeout=180):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


BAD_FLAGS = [
    (["--disagg-peer", "nohost"], "error: --disagg-peer: expected HOST:PORT, got 'nohost'"),
    (["--disagg-kv-port", "99999"], "error: --disagg-kv-port: Input should be less than 65536"),
    (["--disagg-role", "banana"], "argument --disagg-role: invalid choice: 'banana'"),
    (["--disagg-role", "attention"], "vllm-disagg attn-server"),
]


@pytest.fixture(scope="module")
def short_runs(tiny_model_dir) -> dict[str, subprocess.CompletedProcess]:
    """The commands that only parse and exit, started together: each spends ~20 s importing vLLM on
    one core, so six in a row cost two minutes and side by side on 2 cores about one."""
    serve = [BIN / "vllm", "serve", tiny_model_dir, "--plugin", "disagg"]
    argvs = {"version": [BIN / "vllm", "--version"], "help": [*serve, "--help=vllm-disagg"]}
    argvs.update({" ".join(flags): [*serve, *flags] for flags, _ in BAD_FLAGS})
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        futures = {name: pool.submit(run, *argv, timeout=300) for name, argv in argvs.items()}
        return {name: future.result() for name, future in futures.items()}


def test_vllm_version_works_on_the_cpu_wheel_and_keeps_the_cpu_suffix(short_runs):
    proc = short_runs["version"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0.32.0+cpu"


def test_vllm_serve_help_lists_the_plugin_flags(short_runs):
    proc = short_runs["help"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--disagg-role" in proc.stdout and "--plugin NAME" in proc.stdout


@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_a_bad_plugin_flag_gets_a_clear_error_and_no_traceback(short_runs, flags, message):
    proc = short_runs[" ".join(flags)]
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_vllm_disagg_model_path_prints_the_pulled_directory(smollm2_dir):
    proc = run(BIN / "vllm-disagg", "model", "path", "smollm2-135m")
    assert proc.returncode == 0 and proc.stdout.strip() == smollm2_dir


def test_vllm_serve_with_the_plugin_serves_the_embedded_model(smollm2_dir, tmp_path):
    port = free_ports(1)[0]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "vllm-disagg"), "serve", "smollm2-135m", "--port", str(port), "--host", "127.0.0.1",
         "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--served-model-name", "smol"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert "Paris" in text
        assert "'plugin': ['disagg']" in (tmp_path / "serve.log").read_text()  # parsed by vLLM's own parser
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
