# SPDX-License-Identifier: Apache-2.0
"""The engine's side of `/live`: datagrams to the API server's abstract unix socket (no file, gone with
the process). Best effort: a send never blocks and never raises, and with nobody listening (offline
`LLM()`) it costs a failed `sendto`. Three messages, told apart by their size:

- a step starts (`StepBeacon.beat`, EngineCore's scheduler, once per schedule);
- the process runs (`StepBeacon.start_heartbeat`, a thread, once a second);
- a layer of the step in progress finished (`LayerBeacon`, the model's forward, from DisaggConnector's
  `save_kv_layer`): what tells a long step from a stuck one;
- the model worker is rebuilding what a lost attention server held (`recovering`, once a second while
  attention/recovery.py waits for a replacement and recomputes): a step that will not end soon, for a
  known reason, so the router moves new requests elsewhere at once instead of waiting out a stall limit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

__all__ = ["ALIVE_PERIOD_S", "ENV_SOCKET", "LayerBeacon", "StepBeacon", "recovering", "socket_name"]

BEAT = struct.Struct("<iId")  # sender pid, tokens scheduled this step, its start (sender's time.monotonic())
"""The start travels in the datagram: a busy API server reads a few queued beats at once, and their
arrival times made steps of 0 s (a Ray decode instance reported `expected_step_s` 0, so the router
never applied its adaptive stall limit). CLOCK_MONOTONIC is one clock for every process of the host."""
ALIVE = struct.Struct("<i")  # sender pid: EngineCore's process runs (heartbeat thread), nothing about steps
LAYER = struct.Struct("<iII")  # sender pid, index of the layer that finished, number of layers
RECOVERY = struct.Struct("<iBd")  # sender pid, 1 while recovering (0: over), when it began (time.monotonic())
ALIVE_PERIOD_S = 1.0
LAYER_BEAT_GAP_S = 0.2
"""At most one layer datagram per this many seconds: far under any stall limit (the smallest is 2 s),
and a decode step of a few ms sends none past its first layer."""
_MIN_BEAT_GAP_S = 0.05  # busy engines step every few ms: one datagram per 50 ms is plenty
ENV_SOCKET = "VLLM_DISAGG_LIVE_SOCKET"
_HEARTBEATS: set[str] = set()
_HEARTBEATS_LOCK = threading.Lock()


def socket_name(api_server_pid: int) -> str:
    """The abstract socket of the API server `api_server_pid` (EngineCore is its child)."""
    return os.environ.get(ENV_SOCKET) or f"vllm-disagg-live-{api_server_pid}"


class _Datagrams:
    """A non-blocking datagram socket to the API server, opened on first use. A send tries `addrs` in
    order and keeps the first that listens; with none listening, or its queue full, it drops the
    datagram (the next one tries again) and never raises."""

    def __init__(self, names: list[str]) -> None:
        self._addrs = ["\0" + n for n in names]
        self._sock: socket.socket | None = None
        self._pid = os.getpid()

    def _send(self, data: bytes) -> None:
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            for addr in self._addrs:
                try:
                    self._sock.sendto(data, addr)
                except (ConnectionRefusedError, FileNotFoundError):  # nobody listens on this name
                    continue
                self._addrs = [addr]  # found: another name is never tried again
                return
        except OSError:
            pass

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class StepBeacon(_Datagrams):
    """EngineCore side: best effort, never blocks, never raises (no listener: offline `LLM()`)."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__([name or socket_name(os.getppid())])
        self._last = 0.0
        self._last_busy = False
        self._last_tokens = 0

    def beat(self, num_scheduled_tokens: int) -> None:
        """A step of `num_scheduled_tokens` starts. Skipped within 50 ms of the last beat unless the
        engine went idle or busy, or the step is over twice the last beat's size: the API server
        scales its expected step time by the last beat's tokens, and must not think a big prefill
        is a small decode step."""
        now = time.monotonic()
        busy = num_scheduled_tokens > 0
        if (now - self._last < _MIN_BEAT_GAP_S and busy == self._last_busy
                and num_scheduled_tokens <= 2 * self._last_tokens):
            return
        self._last, self._last_busy, self._last_tokens = now, busy, num_scheduled_tokens
        self._send(BEAT.pack(self._pid, max(0, min(num_scheduled_tokens, 2**32 - 1)), now))

    def start_heartbeat(self, period_s: float = ALIVE_PERIOD_S) -> None:
        """Say every `period_s` that this process runs (a daemon thread): an idle engine takes no
        steps, and the API server needs to tell it from a stopped one (`LiveState.report`). Once per
        process and API server: every connector built here shares the thread."""
        (addr,) = self._addrs
        with _HEARTBEATS_LOCK:
            if addr in _HEARTBEATS:
                return
            _HEARTBEATS.add(addr)

        def run() -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            while True:
                try:
                    sock.sendto(ALIVE.pack(self._pid), addr)
                except OSError:
                    pass
                time.sleep(period_s)

        threading.Thread(target=run, name="disagg-live-heartbeat", daemon=True).start()


class LayerBeacon(_Datagrams):
    """Worker side: "layer i of n finished", at most once per `LAYER_BEAT_GAP_S`. A prefill step of a
    long prompt runs for seconds without a step beat; these show it moving, so `/live` needs no
    whole-step margin to keep it from being cut, and a hang inside it is found at the normal limit.

    The worker runs in EngineCore (one rank: its parent is the API server) or in a worker process that
    EngineCore started (tensor parallel: the API server is its grandparent). The first send finds out
    which, by trying both names; `VLLM_DISAGG_LIVE_SOCKET` names it outright."""

    def __init__(self, name: str | None = None, gap_s: float = LAYER_BEAT_GAP_S) -> None:
        super().__init__(_worker_names(name))
        self._gap_s = gap_s
        self._last = 0.0

    def layer_done(self, layer_index: int, num_layers: int) -> None:
        """Called after every attention layer: one clock read unless a datagram is due."""
        now = time.monotonic()
        if now - self._last < self._gap_s:
            return
        self._last = now
        self._send(LAYER.pack(self._pid, max(0, layer_index), max(0, num_layers)))


@contextlib.contextmanager
def recovering(period_s: float = ALIVE_PERIOD_S, name: str | None = None):
    """Tell the API server, every `period_s` for as long as the block runs, that this worker is
    recovering (`LiveState` forgets a recovery not repeated within `RECOVERY_STALE_S`, so a worker
    killed inside the block leaves no flag behind); an end datagram clears it at once."""
    sender = _Datagrams(_worker_names(name))
    pid, began, done = os.getpid(), time.monotonic(), threading.Event()

    def run() -> None:
        while True:
            sender._send(RECOVERY.pack(pid, 1, began))
            if done.wait(period_s):
                return

    thread = threading.Thread(target=run, name="disagg-live-recovering", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
        sender._send(RECOVERY.pack(pid, 0, began))
        sender.close()


def _worker_names(name: str | None) -> list[str]:
    """Where a worker-side sender looks for its API server: `name`, else `VLLM_DISAGG_LIVE_SOCKET`,
    else its parent's and grandparent's names (`LayerBeacon`'s docstring)."""
    if name:
        return [name]
    return [os.environ[ENV_SOCKET]] if os.environ.get(ENV_SOCKET) else _ancestor_names()


def _ancestor_names() -> list[str]:
    """Socket names of this process's parent and grandparent, the two places the API server can be."""
    parent = os.getppid()
    names = [socket_name(parent)]
    grandparent = _parent_of(parent)
    if grandparent:
        names.append(socket_name(grandparent))
    return names


def _parent_of(pid: int) -> int | None:
    """`pid`'s parent from /proc (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
