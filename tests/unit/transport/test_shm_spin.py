# SPDX-License-Identifier: Apache-2.0
"""shm rings with spin-then-block waiting: data stays intact across spinning, sleeping and
full-ring waits, and a reader that fell asleep is woken by the writer (its sleeping flag)."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_disagg.transport import TransportOptions, get_transport
from vllm_disagg.transport.shm import ring


@pytest.fixture
def pair():
    opts = TransportOptions(auth_token="spin-token", spin_us=100.0, timeout_s=10.0)
    tr = get_transport("shm", opts)
    lst = tr.listen_msg()
    client = tr.connect_msg(lst.address, timeout=5)
    server = lst.accept(timeout=5)
    yield client, server
    client.close()
    server.close()
    lst.close()


def _echo(ch, n: int) -> None:
    for _ in range(n):
        msg = ch.recv(timeout=10)
        ch.send(msg.header, [bytes(b) for b in msg.buffers])


def test_spinning_rings_carry_every_size_intact_including_more_than_the_ring(pair):
    client, server = pair
    sizes = [0, 1, 4095, 65536, ring.DEFAULT_RING_BYTES + 12345]  # the last one waits for ring space
    t = threading.Thread(target=_echo, args=(server, len(sizes)), daemon=True)
    t.start()
    for i, n in enumerate(sizes):
        payload = bytes((i + j) % 251 for j in range(min(n, 1000))) * (n // 1000 + 1)
        payload = payload[:n]
        client.send(b"h%d" % i, [payload])
        msg = client.recv(timeout=10)
        assert msg.header == b"h%d" % i and bytes(msg.buffers[0]) == payload
    t.join(10)


def test_a_reader_asleep_past_its_spin_raises_its_flag_and_the_writer_wakes_it(pair):
    client, server = pair
    got = {}

    def reader():
        got["msg"] = server.recv(timeout=10)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rx_ctrl = server.stream._rx.ctrl
    deadline = time.monotonic() + 5
    while not rx_ctrl[ring._SLEEPING]:  # spins 100 us, then sleeps with the flag up
        assert time.monotonic() < deadline, "reader never went to sleep"
        time.sleep(0.001)
    client.send(b"wake", [b"x" * 100])
    t.join(5)
    assert not t.is_alive() and got["msg"].header == b"wake"
    assert rx_ctrl[ring._SLEEPING] == 0
