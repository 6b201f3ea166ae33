# SPDX-License-Identifier: Apache-2.0
"""Start attention servers as local subprocesses (tests, benchmarks, `vllm-disagg up`).

`start_local_servers(n)` runs `python -m vllm_disagg.attention.cli` n times and waits for each
READY file; `LocalServer.kill()` is the fault-injection hook (SIGKILL), `stop()` the clean exit.
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


def start_local_server(transport: str = "shm", kv_cache_gib: float = 0.125, http_port: int = 0,
                       timeout_s: float = 180.0, env: dict | None = None, threads: int = 1,
                       extra_args: tuple[str, ...] = ()) -> LocalServer:
    ready = Path(tempfile.mkdtemp(prefix="attn-server-")) / "ready.json"
    cmd = [sys.executable, "-m", "vllm_disagg.attention.cli", "--transport", transport,
           "--kv-cache-gib", str(kv_cache_gib), "--http-port", str(http_port), "--threads", str(threads), "--ready-file", str(ready), "--parent-pid", str(os.getpid()), *extra_args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"attention server exited with {proc.returncode} before READY: {' '.join(cmd)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"attention server not ready after {timeout_s}s")
        time.sleep(0.05)
    return LocalServer(proc, json.loads(ready.read_text()), ready)


def start_local_servers(n: int, **kwargs) -> list[LocalServer]:
    servers: list[LocalServer] = []
    try:
        for _ in range(n):
            servers.append(start_local_server(**kwargs))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
