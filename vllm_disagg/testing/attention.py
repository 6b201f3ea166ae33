# SPDX-License-Identifier: Apache-2.0
"""Start attention servers as local subprocesses (tests, benchmarks).

`start_local_servers(n)` starts `python -m vllm_disagg.attention.cli` n times at once (their vLLM
imports overlap, ~14 s each here) and waits for every READY file; `LocalServer.kill()` is the fault-injection hook (SIGKILL), `stop()` the clean exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LocalServer:
    proc: subprocess.Popen
    info: dict
    ready_file: Path

    @property
    def http(self) -> str:
        return self.info["http"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn_local_server(transport: str = "shm", kv_cache_gib: float = 0.125, http_port: int = 0,
                       env: dict | None = None, threads: int = 1,
                       extra_args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path, list[str]]:
    """Start one server process; `wait_ready` waits for its READY file."""
    ready = Path(tempfile.mkdtemp(prefix="attn-server-")) / "ready.json"
    cmd = [sys.executable, "-m", "vllm_disagg.attention.cli", "--transport", transport,
           "--kv-cache-gib", str(kv_cache_gib), "--http-port", str(http_port), "--threads", str(threads),
           "--ready-file", str(ready), "--parent-pid", str(os.getpid()), *extra_args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    return proc, ready, cmd


def wait_ready(proc: subprocess.Popen, ready: Path, cmd: list[str], timeout_s: float = 180.0) -> LocalServer:
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"attention server exited with {proc.returncode} before READY: {' '.join(cmd)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"attention server not ready after {timeout_s}s")
        time.sleep(0.05)
    return LocalServer(proc, json.loads(ready.read_text()), ready)


def start_local_server(timeout_s: float = 180.0, **kwargs) -> LocalServer:
    """One server, started and READY (kwargs: `spawn_local_server`'s)."""
    return wait_ready(*spawn_local_server(**kwargs), timeout_s=timeout_s)


def start_local_servers(n: int, timeout_s: float = 180.0, **kwargs) -> list[LocalServer]:
    """n servers, started at once (their imports overlap) and all READY."""
    spawned = []
    servers: list[LocalServer] = []
    try:
        for _ in range(n):
            spawned.append(spawn_local_server(**kwargs))
        for proc, ready, cmd in spawned:
            servers.append(wait_ready(proc, ready, cmd, timeout_s))
    except BaseException:
        for proc, _, _ in spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        raise
    return servers
