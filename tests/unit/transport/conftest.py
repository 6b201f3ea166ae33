# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the transport suite: the backends to run, spawn children, options."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from vllm_disagg.transport import TransportOptions, get_transport, transport_class

TOKEN = "suite-token"
SUITE_KINDS = ["tcp", "shm", "nixl"]

# nixl over UCX on a box without NICs: keep it on loopback/shared memory.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(params=SUITE_KINDS)
def kind(request) -> str:
    reason = transport_class(request.param).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{request.param} cannot run here: {reason}")
    return request.param


@pytest.fixture
def options() -> TransportOptions:
    return TransportOptions(auth_token=TOKEN, timeout_s=10.0, num_streams=3, chunk_bytes=64 << 10)


@pytest.fixture
def transport(kind, options):
    return get_transport(kind, options)


def _context():
    """forkserver with torch preloaded: a real separate process that starts in ~0.1 s instead of
    re-importing torch (seconds on a busy 2-core box); the server forks before any test threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "vllm_disagg.testing.peers"])
    return ctx


class Child:
    """A child process plus the parent's end of its Pipe; killed and reaped at teardown."""

    def __init__(self, target, *args):
        ctx = _context()
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args[:2], child_conn, *args[2:]), daemon=True)
        self.proc.start()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


@pytest.fixture
def spawn():
    children: list[Child] = []

    def start(target, *args) -> Child:
        children.append(Child(target, *args))
        return children[-1]

    yield start
    for c in children:
        c.kill()
