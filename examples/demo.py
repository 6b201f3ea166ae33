# SPDX-License-Identifier: Apache-2.0
"""`make demo`: a disaggregated deployment of SmolLM2 on this box, answering a few chat prompts.

It runs `vllm-disagg up` (1 prefill + 1 decode instance behind the router, KV pushed layer by
layer), waits for the endpoint, sends greedy chat requests, prints the answers, and shuts the
deployment down. `--mixed` serves the same prompts from one plain instance instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="examples/demo.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mixed", action="store_true", help="one plain instance instead of 1P+1D")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    return parser.parse_args(argv)


def up_command(args: argparse.Namespace, state_file: Path) -> list[str]:
    pools = ["--prefill", "0", "--decode", "0", "--mixed", "1"] if args.mixed else ["--prefill", "1", "--decode", "1"]
    return [sys.executable, "-m", "vllm_disagg.cli.main", "up", *pools, "--model", args.model,
            "--port", str(args.port), "--state-file", str(state_file), "--max-model-len", "2048"]


def wait_for_state(proc: subprocess.Popen, state_file: Path, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"demo: `vllm-disagg up` exited with {proc.returncode}")
        if state_file.is_file() and state_file.stat().st_size:
            return json.loads(state_file.read_text())
        time.sleep(1.0)
    raise SystemExit(f"demo: the deployment was not ready after {timeout_s:.0f} s")


def ask(endpoint: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{endpoint}/v1/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"].strip()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state_file = Path(tempfile.mkdtemp(prefix="vllm-disagg-demo-")) / "state.json"
    proc = subprocess.Popen(up_command(args, state_file), start_new_session=True)
    try:
        state = wait_for_state(proc, state_file, args.timeout_s)
        endpoint = state["endpoint"]
        print(f"\nServing {args.model} at {endpoint} ({'mixed' if args.mixed else '1 prefill + 1 decode'})\n")
        for prompt in PROMPTS:
            print(f"> {prompt}\n{ask(endpoint, args.model, prompt, args.max_tokens)}\n", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
