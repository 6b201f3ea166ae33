# SPDX-License-Identifier: Apache-2.0
"""A pair of single-producer/single-consumer byte rings in one memfd, woken by eventfds.

Layout per direction: a 128-byte control block (head at byte 0, writer-waiting flag at 8,
reader-sleeping flag at 16, tail at 64, on separate cache lines) followed by `cap` data bytes.
The writer copies then publishes `tail`; the reader copies out then publishes `head`. Plain
aligned 8-byte stores and x86-64's store ordering (TSO) make this safe without locks; other CPUs
would need explicit barriers.

More: README.md, "shm/ring.py".
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm_disagg.errors import PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.wire import (
    FRAME_HDR,
    T_SHM_SETUP,
    as_byte_view,
    check_frame_crc,
    pack_frame,
    parse_frame_header,
)

CTRL_BYTES = 128
DEFAULT_RING_BYTES = 4 << 20
_HEAD, _WAITING, _SLEEPING, _TAIL = 0, 1, 2, 8  # indexes in the control block viewed as u64
_SPACE_SLICE_S = 0.001
_WAKE_SLICE_S = 0.01
_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """Full memory barrier: the lock's atomic read-modify-write is a LOCK-prefixed instruction."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()
_SETUP = struct.Struct("<Q")


class _Ring:
    def __init__(self, buf: memoryview, cap: int):
        self.ctrl = buf[:CTRL_BYTES].cast("Q")
        self.data = buf[CTRL_BYTES : CTRL_BYTES + cap]
        self.cap = cap


class RingStream:
    """The stream interface of `SockStream` (send_parts/recv_into/recv_exact) over shm rings."""

    def __init__(
        self,
        sock: socket.socket,
        mm: mmap.mmap,
        cap: int,
        efds: list[int],
        server: bool,
        peer: str,
        timeout: float,
        spin_us: float,
    ):
        self.sock, self.peer, self.timeout = sock, peer, timeout
        self._mm, self._spin_s = mm, spin_us * 1e-6
        buf = memoryview(mm)
        a, b = _Ring(buf[: CTRL_BYTES + cap], cap), _Ring(buf[CTRL_BYTES + cap :], cap)
        # efds: [a_data, a_space, b_data, b_space]; the server writes ring a, the client ring b.
        self._tx, self._rx = (a, b) if server else (b, a)
        self._tx_data, self._tx_space = (efds[0], efds[1]) if server else (efds[2], efds[3])
        self._rx_data, self._rx_space = (efds[2], efds[3]) if server else (efds[0], efds[1])
        self._efds = efds
        self._head = self._rx.ctrl[_HEAD]
        self._tail = self._tx.ctrl[_TAIL]
        self._closed = False

    # Sending

    def send_parts(self, parts: Sequence[Any], timeout: float | None = None) -> int:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        tx, total = self._tx, 0
        for part in parts:
            view = as_byte_view(part)
            off, n = 0, view.nbytes
            while off < n:
                free = tx.cap - (self._tail - tx.ctrl[_HEAD])
                if free == 0:
                    self._wake_reader()
                    self._wait_space(deadline)
                    continue
                pos = self._tail % tx.cap
                k = min(free, n - off, tx.cap - pos)
                tx.data[pos : pos + k] = view[off : off + k]
                off += k
                self._tail += k
                tx.ctrl[_TAIL] = self._tail
            total += n
        self._wake_reader()
        return total

    def _wake_reader(self) -> None:
        _fence()  # our tail store must be visible before we read the peer's sleeping flag
        if self._tx.ctrl[_SLEEPING]:
            os.eventfd_write(self._tx_data, 1)

    def _wait_space(self, deadline: float) -> None:
        tx = self._tx
        tx.ctrl[_WAITING] = 1
        try:
            self._wait(
                lambda: tx.cap - (self._tail - tx.ctrl[_HEAD]) > 0, self._tx_space, deadline, _SPACE_SLICE_S
            )
        finally:
            tx.ctrl[_WAITING] = 0

    # Receiving

    def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        rx, off, n = self._rx, 0, view.nbytes
        while off < n:
            avail = rx.ctrl[_TAIL] - self._head
            if avail == 0:
                self._wait_data(deadline)
                continue
            pos = self._head % rx.cap
            k = min(avail, n - off, rx.cap - pos)
            view[off : off + k] = rx.data[pos : pos + k]
            off += k
            self._head += k
            rx.ctrl[_HEAD] = self._head
            if rx.ctrl[_WAITING]:
                os.eventfd_write(self._rx_space, 1)

    def recv_exact(self, n: int, timeout: float | None = None) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), timeout)
        return buf

    def _wait_data(self, deadline: float) -> None:
        rx = self._rx
        ctrl, head = rx.ctrl, self._head
        if self._spin_s > 0:
            clock = time.perf_counter
            spin_end = clock() + self._spin_s
            while clock() < spin_end:
                if ctrl[_TAIL] != head:
                    return
        ctrl[_SLEEPING] = 1
        try:
            _fence()  # the flag must be visible before we read tail (pairs with _wake_reader)
            self._wait(lambda: ctrl[_TAIL] != head, self._rx_data, deadline, _WAKE_SLICE_S, spin=False)
        finally:
            ctrl[_SLEEPING] = 0

    def _wait(self, ready, efd: int, deadline: float, slice_s: float | None, spin: bool = True) -> None:
        if spin and self._spin_s > 0:
            spin_end = time.perf_counter() + self._spin_s
            while time.perf_counter() < spin_end:
                if ready():
                    return
        poller = select.poll()
        poller.register(efd, select.POLLIN)
        poller.register(self.sock, select.POLLIN | select.POLLHUP)
        while not ready():
            if self._closed:
                raise PeerLostError("shm channel closed locally")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"shm ring with {self.peer}: nothing within the timeout")
            wait_s = left if slice_s is None else min(left, slice_s)
            for fd, _ in poller.poll(wait_s * 1000):
                if fd == efd:
                    _drain_eventfd(efd)
                elif not ready() and self.peer_closed():
                    raise PeerLostError(f"shm peer {self.peer} is gone (its socket closed)")

    def peer_closed(self) -> bool:
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            return bool(readable) and self.sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        for fd in self._efds:
            try:
                os.close(fd)
            except OSError:
                pass
        # The mmap stays until garbage collection: views handed out by recv may still point into it.


def _drain_eventfd(efd: int) -> None:
    try:
        os.eventfd_read(efd)
    except BlockingIOError:
        pass


def create_rings(
    sock: socket.socket, peer: str, timeout: float, spin_us: float, cap: int = DEFAULT_RING_BYTES
) -> RingStream:
    """Server side: make the memfd + eventfds, pass them over the unix socket, return our end."""
    size = 2 * (CTRL_BYTES + cap)
    memfd = os.memfd_create("vllm-disagg-ring", os.MFD_CLOEXEC)
    efds: list[int] = []
    try:
        os.ftruncate(memfd, size)
        mm = mmap.mmap(memfd, size)
        efds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(4)]
        frame = pack_frame(T_SHM_SETUP, _SETUP.pack(cap))
        socket.send_fds(sock, [frame], [memfd, *efds])
    except BaseException:
        for fd in efds:
            os.close(fd)
        raise
    finally:
        os.close(memfd)
    return RingStream(sock, mm, cap, efds, True, peer, timeout, spin_us)


def attach_rings(sock: socket.socket, peer: str, timeout: float, spin_us: float) -> RingStream:
    """Client side: receive the memfd + eventfds and map them."""
    want = FRAME_HDR.size + _SETUP.size
    sock.settimeout(timeout)
    try:
        data, fds, _, _ = socket.recv_fds(sock, want, 5)
    except TimeoutError:
        raise TransportTimeout(f"no shm ring setup from {peer} within {timeout}s") from None
    if len(fds) != 5 or len(data) != want:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"bad shm ring setup from {peer}: {len(data)} bytes, {len(fds)} fds")
    memfd, efds = fds[0], fds[1:]
    try:
        ftype, _, _ = parse_frame_header(data[: FRAME_HDR.size], peer)
        check_frame_crc(data[: FRAME_HDR.size], data[FRAME_HDR.size :], peer)
        (cap,) = _SETUP.unpack_from(data, FRAME_HDR.size)
        if ftype != T_SHM_SETUP or os.fstat(memfd).st_size != 2 * (CTRL_BYTES + cap):
            raise ProtocolError(f"bad shm ring setup from {peer}: type {ftype}, cap {cap}")
        mm = mmap.mmap(memfd, 2 * (CTRL_BYTES + cap))
    except BaseException:
        for fd in efds:
            os.close(fd)
        raise
    finally:
        os.close(memfd)
    return RingStream(sock, mm, cap, list(efds), False, peer, timeout, spin_us)
