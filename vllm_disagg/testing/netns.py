# SPDX-License-Identifier: Apache-2.0
"""A loopback-only network namespace for Ray: the Ray tests and `benchmarks/chaos.py --backend ray`
run the Ray nodes, the launcher and every client inside one, so nothing but `lo` is reachable and
`destroy()` kills exactly the namespace's processes. Needs root and iproute2 (`prereqs()`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid


def prereqs() -> str | None:
    """Why this box cannot make a network namespace (None: it can)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns) for a loopback-only network namespace"
    return None


class Netns:
    """A network namespace with only `lo`; every process of the cluster under test runs inside it."""

    def __init__(self, prefix: str = "vdray") -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, *cmd: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*cmd), env=env, capture_output=True, text=True, timeout=timeout)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def destroy(self) -> None:
        """SIGTERM, then SIGKILL, exactly the processes in this namespace; then delete it."""
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.5)
        subprocess.run(["ip", "netns", "delete", self.name], check=False)
