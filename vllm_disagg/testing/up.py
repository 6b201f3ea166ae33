# SPDX-License-Identifier: Apache-2.0
"""Deployments started the way users start them (`vllm-disagg up`), and their HTTP streams, for tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@dataclass
class RunningUp:
    """A `vllm-disagg up` deployment started by `running_up`; `output` is filled on exit."""

    proc: subprocess.Popen
    state_file: Path
    state: dict = field(default_factory=dict)
    output: bytes = b""


@contextlib.contextmanager
def running_up(tmp_path: str | os.PathLike, *argv: str, start_timeout_s: float = 600):
    """`vllm-disagg up --port 0 ... *argv` until its state file appears.

    On leaving the block it SIGTERMs `up`, asserts a clean exit and that no process group of the
    deployment outlived it (the reapers' job), so every test using it also tests shutdown."""
    state_file = Path(tmp_path) / "state.json"
    cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--port", "0", "--state-file", str(state_file),
           "--log-dir", str(Path(tmp_path) / "logs"), *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    up = RunningUp(proc, state_file)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(1)
        up.state = json.loads(state_file.read_text())
        yield up
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        up.output = proc.stdout.read()
        pids = [i["pid"] for i in up.state.get("instances", [])]
        deadline = time.monotonic() + 10  # SIGKILLed members vanish once init reaps them
        while any(group_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if group_alive(p)], "a process group of the deployment outlived `up`"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


async def sse_events(resp):
    """The JSON events of an OpenAI-style SSE stream (aiohttp response), up to `[DONE]`; an error
    event fails the calling test."""
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        yield event
