# SPDX-License-Identifier: Apache-2.0
"""A launcher killed with SIGKILL leaves no server behind (`launch/reaper.py`, used by the local and
Ray launchers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OWNER = """
import subprocess, sys, time
from vllm_disagg.launch.reaper import start_reaper
server = subprocess.Popen(["sleep", "300"], start_new_session=True)
start_reaper(server.pid)
print(server.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (reaped by init later) counts as dead
        return f.read().split()[2] != "Z"


def test_a_server_group_dies_when_its_launcher_is_killed_with_sigkill():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    try:
        time.sleep(0.5)
        assert _alive(server_pid)  # owner alive: the reaper waits
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        if owner.poll() is None:
            owner.kill()
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
