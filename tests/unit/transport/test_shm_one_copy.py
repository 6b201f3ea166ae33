# SPDX-License-Identifier: Apache-2.0
"""shm KV push, one copy: the sender writes straight into the receiver's registered tensors;
partial writes are never notified; bad peers are refused; where the kernel refuses to share or
map memory, the bytes travel inline and still land bit-exact."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from vllm_disagg.errors import ProtocolError, TransportTimeout
from vllm_disagg.testing.peers import crc32_of
from vllm_disagg.transport import BlockWrite, TransportOptions, get_transport
from vllm_disagg.transport.base import XferState
from vllm_disagg.transport.kv_common import SESSION_ID_BYTES, pack_hello, pack_write_meta
from vllm_disagg.transport.shm import _REGION_MAP
from vllm_disagg.transport.wire import (
    T_KV_WRITE,
    T_SHM_SETUP,
    SockStream,
    client_handshake,
    connect_socket,
    pack_frame,
    server_handshake,
)

TOKEN = "one-copy-token"
BLOCK_ELEMS = 2048  # 8 KiB float32 blocks


def _opts(**over) -> TransportOptions:
    return TransportOptions(auth_token=TOKEN, timeout_s=10.0, **over)


def _receiver(shapes: list[tuple[int, int]]):
    rx = get_transport("shm", _opts()).kv_receiver(name="decode")
    caches = [torch.zeros(*shape) for shape in shapes]
    views = [c[1:] for c in caches]  # a view taken before registration (like vLLM's)
    for i, c in enumerate(caches):
        rx.register_region(f"layer.{i}", c)
    rx.start()
    return rx, caches, views


def test_blocks_land_bit_exact_in_the_receivers_own_tensors_with_one_copy():
    rx, caches, views = _receiver([(16, BLOCK_ELEMS), (16, BLOCK_ELEMS)])
    assert all(c.is_shared() for c in caches)  # moved into shared memory in place
    tx = get_transport("shm", _opts()).kv_sender(name="prefill")
    peer = tx.connect(rx.address, timeout=10)
    assert peer.inline_regions == []  # every region is mapped: the sender copies straight in
    src = torch.randn(16, BLOCK_ELEMS)
    ids = [3, 4, 5, 9, 0]
    peer.write_blocks([BlockWrite(f"layer.{i}", src, ids, ids[::-1]) for i in range(2)], "t", -1).wait(10)
    assert rx.wait_notification(timeout=10).nbytes == 2 * len(ids) * BLOCK_ELEMS * 4
    for c, v in zip(caches, views, strict=True):
        assert torch.equal(c[ids[::-1]], src[ids])
        assert v.data_ptr() == c.data_ptr() + c.stride(0) * 4  # earlier views see the same memory
    tx.close()
    rx.close()


def test_the_copy_is_done_when_write_blocks_returns_in_the_callers_thread():
    """The caller copies (no hand-off to the stream thread per write); the stream thread only sends
    the small frame, so blocks land even while that thread cannot run."""
    rx, caches, _ = _receiver([(16, BLOCK_ELEMS)])
    tx = get_transport("shm", _opts()).kv_sender(name="prefill")
    peer = tx.connect(rx.address, timeout=10)
    src = torch.randn(16, BLOCK_ELEMS)
    ids = list(range(16))
    held = threading.Lock()
    with held:  # the stream thread blocks on its first frame
        original = peer._streams[0].send_parts
        peer._streams[0].send_parts = lambda parts, **kw: (held.acquire(), held.release(), original(parts, **kw))
        handle = peer.write_blocks([BlockWrite("layer.0", src, ids, ids)], "t", 0)
        assert torch.equal(caches[0], src)
        assert handle.state() is XferState.PENDING
    handle.wait(10)
    assert rx.wait_notification(timeout=10).transfer_id == "t"
    tx.close()
    rx.close()


def _raw_sender(address: str, name: str) -> SockStream:
    """An authenticated KV stream speaking the wire format by hand (a sender gone wrong)."""
    stream = SockStream(connect_socket(address, 10), address, 10)
    client_handshake(stream, TOKEN.encode(), b"kv", pack_hello(os.urandom(SESSION_ID_BYTES), 0, name))
    socket.recv_fds(stream.sock, 1 << 16, 8)  # SHM_SETUP: maps + fds (unused here)
    return stream


def _wait_lost(rx, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while not (lost := rx.lost_peers()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return lost


def test_a_sender_that_dies_between_chunks_is_lost_and_its_write_never_notified():
    rx, caches, _ = _receiver([(8, BLOCK_ELEMS)])
    stream = _raw_sender(rx.address, "half")
    meta = pack_write_meta(0, 0, 2, 0, 0, b"t", np.array([0, 1], dtype=np.int64))  # chunk 0 of 2
    stream.send_parts([pack_frame(T_KV_WRITE, meta, 0)])
    stream.close()
    assert _wait_lost(rx) == ["half"]
    with pytest.raises(TransportTimeout):
        rx.wait_notification(timeout=0.3)
    rx.close()


def test_a_payload_that_does_not_match_the_write_is_refused():
    rx, _, _ = _receiver([(8, BLOCK_ELEMS)])
    stream = _raw_sender(rx.address, "liar")
    meta = pack_write_meta(0, 0, 1, 0, 0, b"t", np.array([0, 1], dtype=np.int64))
    stream.send_parts([pack_frame(T_KV_WRITE, meta, 100) + b"x" * 100])  # neither 0 nor 16 KiB
    assert _wait_lost(rx) == ["liar"]
    assert rx.stats.num_rejected_frames == 1
    with pytest.raises(TransportTimeout):
        rx.wait_notification(timeout=0.3)
    rx.close()


def test_a_receiver_announcing_a_region_beyond_its_memory_is_refused():
    name = "vd-test-bad-shm-" + os.urandom(4).hex()
    srv = socket.socket(socket.AF_UNIX)
    srv.bind("\0" + name)
    srv.listen(1)
    address = "@" + name

    def serve():
        conn, _ = srv.accept()
        stream = SockStream(conn, "sender", 10)
        server_handshake(stream, TOKEN.encode(), b"kv", lambda hello: _region_table(8))
        fd = os.memfd_create("small")
        os.ftruncate(fd, 4096)  # far smaller than the 8 blocks announced
        meta = (1).to_bytes(4, "little") + _REGION_MAP.pack(0, 0, 8 * BLOCK_ELEMS * 4)
        socket.send_fds(conn, [pack_frame(T_SHM_SETUP, meta)], [fd])
        os.close(fd)
        time.sleep(0.2)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with pytest.raises(ProtocolError, match="does not fit"):
        get_transport("shm", _opts()).kv_sender(name="p").connect(address, timeout=10)
    t.join(5)
    srv.close()


def _region_table(num_blocks: int) -> bytes:
    from vllm_disagg.transport.base import RegionInfo
    from vllm_disagg.transport.kv_common import pack_region_table

    return pack_region_table([RegionInfo("layer.0", num_blocks, BLOCK_ELEMS * 4)])


_SMALL_SHM_RECEIVER = textwrap.dedent(
    """
    import sys, torch
    from vllm_disagg.transport import TransportOptions, get_transport
    from vllm_disagg.testing.peers import crc32_of
    rx = get_transport("shm", TransportOptions(auth_token=sys.argv[1])).kv_receiver(name="small-shm")
    caches = [torch.zeros(4, 2048), torch.zeros(128, 2048)]  # 32 KiB fits a 1 MiB /dev/shm, 1 MiB not
    for i, t in enumerate(caches):
        rx.register_region(f"layer.{i}", t)
    print(rx.start(), *[int(t.is_shared()) for t in caches], flush=True)
    rx.wait_notification(timeout=20)
    print(crc32_of(caches), flush=True)
    rx.close()
    """
)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_a_region_the_kernel_will_not_share_travels_inline_and_lands_bit_exact():
    """The receiver runs with a 1 MiB /dev/shm (as small as a container's): its big region stays
    private and is sent inline; the small one still gets the one-copy path."""
    mount = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -c "$1" "$2"'
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", mount, sys.executable, _SMALL_SHM_RECEIVER, TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().split()
        if not line:
            pytest.skip(f"cannot run a receiver in a mount namespace here: {proc.stderr.read()[-300:]}")
        address, shared = line[0], line[1:]
        assert shared == ["1", "0"]
        tx = get_transport("shm", _opts()).kv_sender(name="prefill")
        peer = tx.connect(address, timeout=10)
        assert peer.inline_regions == ["layer.1"]
        srcs = [torch.randn(4, 2048), torch.randn(128, 2048)]
        writes = [BlockWrite(f"layer.{i}", s, range(len(s)), range(len(s))) for i, s in enumerate(srcs)]
        peer.write_blocks(writes, "t", -1).wait(10)
        assert int(proc.stdout.readline()) == crc32_of(srcs)
        tx.close()
    finally:
        proc.kill()
        proc.wait(10)


_CAPPED_SENDER = textwrap.dedent(
    """
    import json, resource, sys, torch
    from vllm_disagg.transport import BlockWrite, TransportOptions, get_transport
    vm_kib = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1])
    resource.setrlimit(resource.RLIMIT_AS, ((vm_kib << 10) + (96 << 20), resource.RLIM_INFINITY))
    tx = get_transport("shm", TransportOptions(auth_token=sys.argv[1])).kv_sender(name="capped")
    peer = tx.connect(sys.argv[2], timeout=10)
    src = torch.arange(2 * 262144, dtype=torch.float32).reshape(2, 262144)
    peer.write_blocks([BlockWrite("layer.0", src, [0, 1], [5, 7])], "t", 0).wait(10)
    print(json.dumps(peer.inline_regions), flush=True)
    tx.close()
    """
)


def test_a_sender_that_cannot_map_the_regions_sends_inline_and_they_land_bit_exact():
    """RLIMIT_AS leaves the sender no room to map a 256 MiB region: mmap fails, bytes go inline."""
    rx, caches, _ = _receiver([(256, 262144)])  # 1 MiB blocks
    out = subprocess.run(
        [sys.executable, "-c", _CAPPED_SENDER, TOKEN, rx.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == '["layer.0"]'
    assert rx.wait_notification(timeout=10).nbytes == 2 << 20
    src = torch.arange(2 * 262144, dtype=torch.float32).reshape(2, 262144)
    assert torch.equal(caches[0][[5, 7]], src)
    rx.close()
