# SPDX-License-Identifier: Apache-2.0
"""The chaos `corrupt_link` fault's tool: a proxy that flips one byte a set distance past what it has
forwarded so far, once, and forwards everything else untouched."""

from __future__ import annotations

import random
import socket
import threading
import time

from vllm_disagg.testing.chaos.campaign import CampaignConfig, plan_faults
from vllm_disagg.testing.throttle import ThrottledProxy


def _sink() -> tuple[socket.socket, bytearray, threading.Event]:
    listener = socket.create_server(("127.0.0.1", 0))
    got, done = bytearray(), threading.Event()

    def serve():
        conn, _ = listener.accept()
        with conn:
            while chunk := conn.recv(65536):
                got.extend(chunk)
        done.set()

    threading.Thread(target=serve, daemon=True).start()
    return listener, got, done


def _wait(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_flip_after_flips_exactly_one_byte_that_far_past_the_bytes_already_forwarded():
    listener, got, done = _sink()
    proxy = ThrottledProxy(f"127.0.0.1:{listener.getsockname()[1]}", rate_bytes_per_s=None)
    sent = bytes(range(256)) * 16  # 4 KiB
    try:
        with socket.create_connection(proxy.address.split(":")) as conn:
            conn.sendall(sent)
            _wait(lambda: len(got) == len(sent))
            proxy.flip_after(1000)
            conn.sendall(sent)
            conn.sendall(sent)  # past the flip: untouched
        _wait(done.is_set)
    finally:
        proxy.close()
        listener.close()
    expected = bytearray(sent * 3)
    expected[len(sent) + 1000] ^= 0xFF
    assert got == expected and proxy.num_corrupted == 1


def test_a_flip_cancelled_before_its_byte_passes_changes_nothing():
    listener, got, done = _sink()
    proxy = ThrottledProxy(f"127.0.0.1:{listener.getsockname()[1]}", rate_bytes_per_s=None)
    try:
        proxy.flip_after(10_000)
        with socket.create_connection(proxy.address.split(":")) as conn:
            conn.sendall(b"x" * 5000)
            _wait(lambda: len(got) == 5000)
            proxy.cancel_flip()
            conn.sendall(b"x" * 10_000)
        _wait(done.is_set)
    finally:
        proxy.close()
        listener.close()
    assert got == b"x" * 15_000 and proxy.num_corrupted == 0


def test_link_faults_are_planned_without_a_role():
    cfg = CampaignConfig(duration_s=200.0, rps=0.5, seed=0, kinds=("corrupt_link", "slow_link", "kill"),
                         fault_every_s=(10.0, 20.0))
    plan = plan_faults(cfg, ["prefill", "decode"], random.Random(0))
    assert {role for kind, role in plan if kind != "kill"} == {""}
    assert {kind for kind, _ in plan} == {"corrupt_link", "slow_link", "kill"}
