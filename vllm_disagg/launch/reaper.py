# SPDX-License-Identifier: Apache-2.0
"""Kill a server's process group when its owner dies: `python -m vllm_disagg.launch.reaper FD PGID`.

Why: a Ray actor that is killed (`ray.kill`, node OOM, crash), or a `vllm-disagg up` that gets
SIGKILL, has no chance to stop the `vllm serve` processes it started in their own sessions, and
vLLM's EngineCore would outlive it. The owner keeps the
write end of a pipe open; this process blocks on the read end (FD). EOF means the owner is gone, so
the whole group gets SIGTERM, then SIGKILL after a grace period. No polling, no pid reuse races.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def reap(read_fd: int, pgid: int, grace_s: float = 10.0) -> None:
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while pipe.read(1):  # the owner never writes; b"" (EOF) means it exited
            pass
    if not _group_alive(pgid):
        return
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def start_reaper(pgid: int) -> int:
    """Spawn the reaper of process group `pgid`. Returns the pipe's write end: the caller keeps it
    open for as long as it owns the group (its death closes it); closing it after a clean stop lets
    the reaper exit."""
    read_fd, write_fd = os.pipe()
    subprocess.Popen([sys.executable, "-m", "vllm_disagg.launch.reaper", str(read_fd), str(pgid)],
                     pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL)
    os.close(read_fd)
    return write_fd


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m vllm_disagg.launch.reaper READ_FD PGID", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's death ends this process
    reap(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
