# SPDX-License-Identifier: Apache-2.0
"""What a killed instance leaves in /dev/shm, removed by the launcher that restarts it.

vLLM's engine and its workers share memory through /dev/shm files (`psm_*` message queues, `sem.mp-*`
semaphores) that they unlink on a clean exit. A SIGKILLed instance (a crash, the OOM killer, a chaos
run) unlinks nothing: measured, three entries per killed decode instance. `ShmSweeper` remembers
which /dev/shm files each instance's process group has mapped (from /proc/<pid>/maps, polled by the
supervisor) and, once the group is gone, unlinks those that no live process still maps, and the
unmapped `sem.mp-*` files created since the dead group started (why: README.md, "shm_sweep.py").
"Mapped" is judged by inode: a live semaphore's creator maps it under glibc's temporary name.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
SEMAPHORE_PREFIX = "sem.mp-"
CTIME_SLACK_S = 0.1
"""File times come from the kernel's coarse clock, a few ms behind time.time()."""


def group_pids(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


def _shm_mappings(pids: list[int]):
    """(inode, name) of every /dev/shm mapping of the processes `pids`."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM_DIR + "/")
                    if i >= 0:  # "addr perms offset dev inode path"
                        yield int(line.split()[4]), line[i + len(SHM_DIR) + 1:].split()[0]
        except (OSError, ValueError, IndexError):
            continue


def mapped_shm(pids: list[int]) -> set[str]:
    """Names of the /dev/shm files the processes `pids` have mapped."""
    return {name for _, name in _shm_mappings(pids)}


def mapped_inodes() -> set[int]:
    """Inodes of the /dev/shm files some live process on the box has mapped. By inode, not name: glibc's
    sem_open maps a semaphore under a temporary name (`sem.XXXXXX (deleted)`) and then links it as
    `sem.mp-*`, so its creator's mapping never shows the name (a sweep by name removed another
    deployment's fresh semaphore, and that instance's worker failed to start: FileNotFoundError)."""
    return {inode for inode, _ in _shm_mappings([int(p) for p in os.listdir("/proc") if p.isdigit()])}


def mapped_by_any_process(names: set[str]) -> set[str]:
    """Those of the /dev/shm files `names` that exist and some live process maps (by inode)."""
    inodes = _inodes(names)
    alive = mapped_inodes()  # after the stat: a file created later is not in `names`' answer
    return {name for name, inode in inodes.items() if inode in alive}


def _inodes(names: set[str]) -> dict[str, int]:
    out = {}
    for name in names:
        try:
            out[name] = os.stat(os.path.join(SHM_DIR, name)).st_ino
        except OSError:
            continue
    return out


class ShmSweeper:
    """Per instance name: the /dev/shm files its group mapped; `sweep` unlinks the orphaned ones."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}
        self._since: dict[str, float] = {}

    def started(self, name: str) -> None:
        """A new incarnation of `name` starts now: semaphores created from here on may be its."""
        self._since[name] = time.time()

    def record(self, name: str, pgid: int) -> None:
        """What `name`'s group maps now."""
        self._seen.setdefault(name, set()).update(mapped_shm(group_pids(pgid)))

    def sweep(self, name: str) -> list[str]:
        """`name`'s group is gone: unlink the files it mapped, and the semaphores created since it started,
        that no live process maps now."""
        candidates = self._seen.pop(name, set()) | semaphores_since(self._since.pop(name, time.time()))
        return unlink_orphans(candidates, name)


class ShmRecord:
    """`ShmSweeper` for one Ray instance actor, kept in a file on the node: a SIGKILLed actor (its
    reaper takes the server along) sweeps nothing, so the next incarnation, restarted by Ray on the
    same node, reads what the last one's server mapped and removes it. Without it every kill left
    the engine's message queues (~420 MB for two kills in the Ray chaos run) until the node rebooted."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def started(self, pgid: int) -> None:
        self._write({"pgid": pgid, "since": time.time(), "names": []})

    def record(self) -> None:
        data = self._read()
        if data:
            data["names"] = sorted(set(data["names"]) | mapped_shm(group_pids(data["pgid"])))
            self._write(data)

    def sweep(self, label: str, wait_s: float = 15.0) -> list[str]:
        """The recorded server is gone (or going: waits up to `wait_s` for its group to die): unlink its
        files and the semaphores created since it started that no live process maps; forget the record."""
        data = self._read()
        if not data:
            return []
        deadline = time.monotonic() + wait_s
        while group_pids(data["pgid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        removed = unlink_orphans(set(data["names"]) | semaphores_since(data["since"]), label)
        self.path.unlink(missing_ok=True)
        return removed

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _write(self, data: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)


def unlink_orphans(candidates: set[str], label: str) -> list[str]:
    """Unlink the /dev/shm files `candidates` that exist and no live process maps."""
    existing = set(_inodes(candidates))
    if not existing:
        return []
    removed = []
    for shm in sorted(existing - mapped_by_any_process(existing)):
        try:
            os.unlink(os.path.join(SHM_DIR, shm))
            removed.append(shm)
        except OSError:
            pass
    if removed:
        logger.warning("removed %d /dev/shm files %s left by %s (killed without cleanup)", len(removed),
                       removed, label)
    return removed


def semaphores_since(since: float) -> set[str]:
    """`sem.mp-*` files created at or after `since` (wall-clock seconds)."""
    names = set()
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(SEMAPHORE_PREFIX):
            try:
                if os.stat(os.path.join(SHM_DIR, entry)).st_ctime >= since - CTIME_SLACK_S:
                    names.add(entry)
            except OSError:
                continue
    return names
