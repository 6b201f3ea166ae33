# SPDX-License-Identifier: Apache-2.0
"""A SIGKILLed instance's /dev/shm files are removed by the launcher, and only those nobody maps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from vllm_disagg.launch.shm_sweep import ShmSweeper, group_pids

_CHILD = """
import mmap, sys, time
f = open(sys.argv[1], "r+b"); m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True); time.sleep(60)
"""


def _shm_file() -> str:
    path = f"/dev/shm/vd-sweep-test-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    return path


def _mapper(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, path], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"mapped"
    return proc


def test_the_files_a_killed_group_mapped_are_unlinked_and_a_shared_one_is_kept():
    mine, shared = _shm_file(), _shm_file()
    killed, other = _mapper(mine), _mapper(shared)
    bystander = _mapper(shared)
    try:
        sweeper = ShmSweeper()
        assert group_pids(killed.pid) == [killed.pid]
        sweeper.record("decode0", killed.pid)
        sweeper.record("decode0", other.pid)  # as if the group had mapped `shared` too
        os.killpg(killed.pid, signal.SIGKILL)
        os.killpg(other.pid, signal.SIGKILL)
        killed.wait(5)
        other.wait(5)
        time.sleep(0.1)
        assert sweeper.sweep("decode0") == [os.path.basename(mine)]  # `shared` is still mapped elsewhere
        assert not os.path.exists(mine) and os.path.exists(shared)
        assert sweeper.sweep("decode0") == []
    finally:
        bystander.kill()
        for path in (mine, shared):
            if os.path.exists(path):
                os.unlink(path)


def test_unmapped_semaphores_created_since_the_group_started_are_unlinked_older_ones_kept():
    """Python's named semaphores are mapped by no one once their objects are gone; a SIGKILLed resource
    tracker leaves them: the sweep takes those created during the dead incarnation's life."""
    older = f"/dev/shm/sem.mp-vd-test-{uuid.uuid4().hex[:8]}"
    open(older, "wb").close()
    time.sleep(0.3)
    sweeper = ShmSweeper()
    sweeper.started("decode0")
    newer = f"/dev/shm/sem.mp-vd-test-{uuid.uuid4().hex[:8]}"
    open(newer, "wb").close()
    try:
        assert sweeper.sweep("decode0") == [os.path.basename(newer)]
        assert os.path.exists(older) and not os.path.exists(newer)
    finally:
        for path in (older, newer):
            if os.path.exists(path):
                os.unlink(path)


_SEMAPHORE_OWNER = """
import multiprocessing, time
lock = multiprocessing.get_context("spawn").Lock()  # what vLLM's executor makes for the worker it spawns
print(lock._semlock.name, flush=True); time.sleep(60)
"""


def test_a_live_processs_fresh_semaphore_is_kept_though_its_name_is_mapped_nowhere():
    """Another deployment's engine, starting while this one's instance dies: its executor created a
    semaphore for the worker it is about to spawn. glibc maps it under a temporary name, so by name it
    looked orphaned, and the sweep unlinked it (that worker then failed: FileNotFoundError). By inode it
    is live."""
    sweeper = ShmSweeper()
    sweeper.started("decode0")
    owner = subprocess.Popen([sys.executable, "-c", _SEMAPHORE_OWNER], stdout=subprocess.PIPE, start_new_session=True)
    orphan = f"/dev/shm/sem.mp-vd-test-{uuid.uuid4().hex[:8]}"
    try:
        name = "sem" + owner.stdout.readline().decode().strip().replace("/", ".")
        open(orphan, "wb").close()
        assert os.path.exists(f"/dev/shm/{name}")
        assert sweeper.sweep("decode0") == [os.path.basename(orphan)]
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        owner.kill()
        owner.wait(5)
        if os.path.exists(orphan):
            os.unlink(orphan)


def test_a_ray_actors_record_lets_its_next_incarnation_remove_what_the_killed_server_mapped(tmp_path):
    """The record lives in a file: the actor that wrote it is gone (SIGKILL), a new one reads it."""
    from vllm_disagg.launch.shm_sweep import ShmRecord

    mine, shared = _shm_file(), _shm_file()
    server, bystander = _mapper(mine), _mapper(shared)
    extra = _mapper(shared)  # the server's group also maps `shared`, which the bystander keeps
    record_path = tmp_path / "ns-decode0.json"
    try:
        first = ShmRecord(record_path)
        first.started(server.pid)
        first.record()
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(5)
        extra.kill()
        extra.wait(5)
        del first  # the killed actor: nothing of it but the file
        assert ShmRecord(record_path).sweep("decode0") == [os.path.basename(mine)]
        assert not os.path.exists(mine) and os.path.exists(shared) and not record_path.exists()
        assert ShmRecord(record_path).sweep("decode0") == []  # nothing recorded: nothing removed
    finally:
        bystander.kill()
        for path in (mine, shared):
            if os.path.exists(path):
                os.unlink(path)


def test_the_sweep_waits_for_the_recorded_group_to_die_and_keeps_what_a_live_group_maps(tmp_path):
    from vllm_disagg.launch.shm_sweep import ShmRecord

    mine = _shm_file()
    server = _mapper(mine)
    try:
        record = ShmRecord(tmp_path / "r.json")
        record.started(server.pid)
        record.record()
        t0 = time.monotonic()
        assert record.sweep("decode0", wait_s=0.5) == []  # still alive after the wait: kept
        assert time.monotonic() - t0 >= 0.5 and os.path.exists(mine)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(5)
        os.unlink(mine)
