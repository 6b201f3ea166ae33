# SPDX-License-Identifier: Apache-2.0
"""The baselines of `transport_bench.py`: what a user would run instead, each at its best.

* `RawTcp`: plain sockets, `num_streams` connections, one thread per stream on both sides,
  `sendall` / `recv_into` a preallocated buffer; 16 KiB ping-pong on stream 0.
* `RawNixl`: NIXL 1.5.1 as its docs recommend for speed: memory registered once, descriptor
  lists prepared once (`prep_xfer_dlist`), transfer handles made once and re-posted
  (`transfer(handle, notif)`), no progress thread, both sides busy-polling.
Every transfer is clocked from the sender's first call to the receiver's own `perf_counter()`
(CLOCK_MONOTONIC, one clock for all processes) when it saw the data land, so the control Pipe's
wake-up is never inside a measurement. Each child reports a CRC of what it received: a baseline
that moved no bytes fails the run instead of giving a ratio.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_STAMP = struct.Struct("<d")


def spawn(target, *args, conn_at: int = 0):
    """Start `target(*args)` in a spawn child, with its Pipe end inserted at `conn_at`;
    returns (process, parent conn)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (*args[:conn_at], child, *args[conn_at:])
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc, parent


def expect(conn, tag: str, timeout: float = 120.0) -> tuple:
    """Next message from a child, which must carry `tag` (a child's error is raised here)."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {tag!r} from the child within {timeout}s")
    msg = conn.recv()
    if msg[0] != tag:
        raise RuntimeError(f"child sent {msg!r}, expected {tag!r}")
    return msg


def pattern(nbytes: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def stop(proc, conn) -> None:
    try:
        conn.send(("exit",))
    except OSError:
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# Raw TCP


def _slices(nbytes: int, num_streams: int) -> list[tuple[int, int]]:
    step = -(-nbytes // num_streams)
    return [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:], view.nbytes - got)
        if k == 0:
            raise ConnectionError("raw tcp peer closed")
        got += k


def buffer(nbytes: int, memory: str) -> np.ndarray:
    """A byte buffer of the kind the KV cache lives in ("torch": torch's CPU allocator, 4 KiB
    pages) or numpy's (which asks for transparent huge pages on big arrays)."""
    if memory == "torch":
        return torch.zeros(nbytes, dtype=torch.uint8).numpy()
    return np.zeros(nbytes, dtype=np.uint8)


def raw_tcp_child(conn, nbytes: int, num_streams: int, msg_bytes: int, memory: str) -> None:
    """Commands: ("bw", n): receive n transfers (each stream its slice), reply on stream 0 with
    the time all slices had landed; ("echo", n): echo n messages on stream 0; ("crc",); ("exit",)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(num_streams)
    conn.send(("addr", srv.getsockname()[1]))
    socks = [None] * num_streams
    for _ in range(num_streams):
        s, _ = srv.accept()
        s.settimeout(120)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks[s.recv(1)[0]] = s
    buf = memoryview(buffer(nbytes, memory))
    pong = memoryview(bytearray(msg_bytes))
    slices = _slices(nbytes, num_streams)
    while (cmd := conn.recv())[0] != "exit":
        if cmd[0] == "bw":
            barrier = threading.Barrier(num_streams)

            def receive(i: int, count: int = cmd[1], barrier: threading.Barrier = barrier) -> None:
                for _ in range(count):
                    _recv_exact(socks[i], buf[slices[i][0] : slices[i][1]])
                    barrier.wait()
                    if i == 0:
                        socks[0].sendall(_STAMP.pack(time.perf_counter()))

            threads = [threading.Thread(target=receive, args=(i,)) for i in range(num_streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elif cmd[0] == "echo":
            for _ in range(cmd[1]):
                _recv_exact(socks[0], pong)
                socks[0].sendall(pong)
        conn.send(("ok", zlib.crc32(buf) if cmd[0] == "crc" else 0))
    for s in socks:
        s.close()


class RawTcp:
    """`num_streams` plain TCP connections to a child process, one sender thread per stream;
    both buffers are of the KV cache's kind (`memory`), as the push's are."""

    def __init__(self, nbytes: int, num_streams: int, msg_bytes: int, memory: str = "torch"):
        self.nbytes, self.num_streams = nbytes, num_streams
        self.proc, self.conn = spawn(raw_tcp_child, nbytes, num_streams, msg_bytes, memory)
        port = expect(self.conn, "addr")[1]
        self.socks = []
        for i in range(num_streams):
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(bytes([i]))
            self.socks.append(s)
        self.src = buffer(nbytes, memory)
        self.src[:] = pattern(nbytes)
        self.views = [memoryview(self.src[lo:hi]) for lo, hi in _slices(nbytes, num_streams)]
        self.pool = ThreadPoolExecutor(num_streams)
        self.ping, self.pong = memoryview(bytearray(msg_bytes)), memoryview(bytearray(msg_bytes))
        self.bw(1)

    def bw(self, count: int) -> list[float]:
        """`count` transfers back to back; seconds each, until the child had every byte."""
        self.conn.send(("bw", count))
        stamp = memoryview(bytearray(_STAMP.size))
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            for f in [self.pool.submit(s.sendall, v) for s, v in zip(self.socks, self.views, strict=True)]:
                f.result()
            _recv_exact(self.socks[0], stamp)
            out.append(_STAMP.unpack(stamp)[0] - t0)
        expect(self.conn, "ok")
        return out

    def rtt(self, count: int) -> list[float]:
        self.conn.send(("echo", count))
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            self.socks[0].sendall(self.ping)
            _recv_exact(self.socks[0], self.pong)
            out.append(time.perf_counter() - t0)
        expect(self.conn, "ok")
        return out

    def verify(self) -> None:
        self.conn.send(("crc",))
        if expect(self.conn, "ok")[1] != zlib.crc32(self.src):
            raise RuntimeError("raw tcp baseline: the receiver's bytes differ from what was sent")

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.pool.shutdown()
        stop(self.proc, self.conn)


# Raw NIXL


def _nixl_endpoint(conn, role: str, nbytes: int, msg_bytes: int, num_pieces: int):
    """Agent + one registered buffer [bulk | ping slot | pong slot]; metadata swapped over the
    Pipe; both descriptor lists prepared once: the bulk as `num_pieces` equal descriptors
    (indices 0..num_pieces-1), then ping, then pong. Returns what the transfers need."""
    from vllm_disagg.transport.nixl.agent import make_agent

    agent, _ = make_agent(role)
    buf = torch.zeros(nbytes + 2 * msg_bytes, dtype=torch.uint8)
    reg = agent.register_memory(buf)
    conn.send(("meta", agent.get_agent_metadata(), buf.data_ptr()))
    _, meta, remote_base = expect(conn, "meta")
    remote = agent.add_remote_agent(meta)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    piece = nbytes // num_pieces

    def spans(at: int) -> list[tuple[int, int, int]]:
        bulk = [(at + i * piece, piece, 0) for i in range(num_pieces)]
        return [*bulk, (at + nbytes, msg_bytes, 0), (at + nbytes + msg_bytes, msg_bytes, 0)]

    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", spans(buf.data_ptr()), "DRAM")
    peer = agent.prep_xfer_dlist(remote, spans(remote_base), "DRAM")
    return agent, remote, buf, reg, local, peer


_NIXL_WAIT_S = 60.0  # a busy-poll that outlives this means the peer is gone


def _pause(poll: str) -> None:
    if poll == "yield":  # hand the core over between polls (2-core box: the peer may need it)
        os.sched_yield()


def _wait_done(agent, handle, poll: str = "spin") -> None:
    deadline = time.monotonic() + _NIXL_WAIT_S
    while (state := agent.check_xfer_state(handle)) != "DONE":
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"raw nixl transfer ended in state {state}")
        _pause(poll)


def _wait_notifs(agent, remote: str, count: int = 1, poll: str = "spin") -> list[float]:
    """Poll until `count` notifications from `remote` arrived; the time each was seen."""
    deadline = time.monotonic() + _NIXL_WAIT_S
    stamps: list[float] = []
    while len(stamps) < count:
        got = agent.get_new_notifs().get(remote)
        if got:
            stamps += [time.perf_counter()] * len(got)
        elif time.monotonic() > deadline:
            raise TimeoutError("raw nixl: no notification from the peer")
        else:
            _pause(poll)
    return stamps


def raw_nixl_child(conn, nbytes: int, msg_bytes: int, num_pieces: int) -> None:
    """Target side. ("bw", n, poll): poll for n WRITE notifications, reply with the time each
    was seen; ("echo", n, poll): answer n pings with a prepared WRITE into the parent's pong slot."""
    agent, remote, buf, _, local, peer = _nixl_endpoint(conn, "raw-rx", nbytes, msg_bytes, num_pieces)
    pong = agent.make_prepped_xfer("WRITE", local, [num_pieces + 1], peer, [num_pieces + 1], b"p")
    while (cmd := conn.recv())[0] != "exit":
        if cmd[0] == "bw":
            conn.send(("ok", _wait_notifs(agent, remote, cmd[1], cmd[2])))
        elif cmd[0] == "echo":
            for _ in range(cmd[1]):
                _wait_notifs(agent, remote, 1, cmd[2])
                agent.transfer(pong, b"p")
                _wait_done(agent, pong, cmd[2])
            conn.send(("ok", []))
        elif cmd[0] == "crc":
            conn.send(("ok", zlib.crc32(buf[:nbytes].numpy())))
    os._exit(0)  # UCX teardown at exit is slow and noisy; nothing is left to flush


class RawNixl:
    """NIXL WRITE + notification, prepared once, re-posted for every transfer. The bulk goes as
    `num_pieces` descriptors in one transfer. Polling as measured best on the 2-core box (see
    the transport README): bulk transfers yield the CPU between polls (4.0 against 1.7 GB/s
    spinning: the side whose UCX progress does the copy needs the core), round trips spin
    (47 against 87 us)."""

    def __init__(self, nbytes: int, msg_bytes: int, num_pieces: int = 32, bw_poll="yield", rtt_poll="spin"):
        self.nbytes, self.bw_poll, self.rtt_poll = nbytes, bw_poll, rtt_poll
        self.proc, self.conn = spawn(raw_nixl_child, nbytes, msg_bytes, num_pieces)
        self.agent, self.remote, self.buf, _, local, peer = _nixl_endpoint(
            self.conn, "raw-tx", nbytes, msg_bytes, num_pieces
        )
        self.buf[:nbytes] = torch.from_numpy(pattern(nbytes))
        pieces = list(range(num_pieces))
        self.local, self.peer = local, peer
        self.bulk = self.agent.make_prepped_xfer("WRITE", local, pieces, peer, pieces, b"b")
        self.ping = self.agent.make_prepped_xfer("WRITE", local, [num_pieces], peer, [num_pieces], b"q")
        self.bw(1)

    def bw(self, count: int) -> list[float]:
        self.conn.send(("bw", count, self.bw_poll))
        starts = []
        for _ in range(count):
            starts.append(time.perf_counter())
            if self.agent.transfer(self.bulk, b"b") == "ERR":
                raise RuntimeError("raw nixl WRITE failed to start")
            _wait_done(self.agent, self.bulk, self.bw_poll)
        stamps = expect(self.conn, "ok")[1]
        return [end - start for start, end in zip(starts, stamps, strict=True)]

    def rtt(self, count: int) -> list[float]:
        self.conn.send(("echo", count, self.rtt_poll))
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            self.agent.transfer(self.ping, b"q")
            _wait_done(self.agent, self.ping, self.rtt_poll)
            _wait_notifs(self.agent, self.remote, 1, self.rtt_poll)
            out.append(time.perf_counter() - t0)
        expect(self.conn, "ok")
        return out

    def verify(self) -> None:
        self.conn.send(("crc",))
        if expect(self.conn, "ok")[1] != zlib.crc32(self.buf[: self.nbytes].numpy()):
            raise RuntimeError("raw nixl baseline moved no bytes (the receiver's buffer differs)")

    def close(self) -> None:
        stop(self.proc, self.conn)
