# SPDX-License-Identifier: Apache-2.0
"""A throttled TCP link for tests and chaos: a loopback proxy that forwards client -> target at a set
byte rate (the other way at full speed), and can flip one byte on the way (`corrupt_at`).

A slow link is the fault a killed or stopped peer does not show: the sender's writes complete into
its socket buffers at once, and the bytes keep landing at the receiver long after either side gave
up. Point a sender at `address` instead of the target's own (for the KV push: the decode side's
advertised receiver address). Bounded: every socket closes with `close()`.
"""

from __future__ import annotations

import socket
import threading
import time

_CHUNK = 1024


class ThrottledProxy:
    def __init__(self, target: str, rate_bytes_per_s: float | None, host: str = "127.0.0.1", port: int = 0,
                 corrupt_at: int | None = None):
        self.target = target
        self.corrupt_at = corrupt_at
        """Flip the byte at this offset of everything sent client -> target (all connections, in the
        order forwarded), once: the damage no frame check sees when it falls inside a payload."""
        self.num_corrupted = 0
        self._offset = 0
        self.rate: float | None = None
        """Bytes per second client -> target; None: full speed (`set_rate` switches it, e.g. for a fault window)."""
        self.set_rate(rate_bytes_per_s)
        self.num_forwarded = 0
        """Bytes forwarded client -> target so far."""
        self._listener = socket.create_server((host, port))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="throttle-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            try:
                upstream = socket.create_connection((host, int(port)), timeout=5.0)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def set_rate(self, rate_bytes_per_s: float | None) -> None:
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError(f"rate must be positive, got {rate_bytes_per_s}")
        self.rate = None if rate_bytes_per_s is None else float(rate_bytes_per_s)

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        due = time.monotonic()  # when the next chunk may go: a byte budget at the current rate
        try:
            while data := src.recv(_CHUNK if throttled else 65536):
                rate = self.rate if throttled else None
                if rate is not None:
                    due = max(due, time.monotonic()) + len(data) / rate
                    time.sleep(max(0.0, due - time.monotonic()))
                if throttled:
                    data = self._maybe_corrupt(data)
                dst.sendall(data)
                if throttled:
                    with self._lock:
                        self.num_forwarded += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _maybe_corrupt(self, data: bytes) -> bytes:
        with self._lock:
            start, self._offset = self._offset, self._offset + len(data)
            at = self.corrupt_at
            if at is None or not start <= at < start + len(data):
                return data
            self.corrupt_at, self.num_corrupted = None, self.num_corrupted + 1
        flipped = bytearray(data)
        flipped[at - start] ^= 0xFF
        return bytes(flipped)

    def flip_after(self, num_bytes: int) -> None:
        """Flip one byte `num_bytes` past what has been forwarded so far (`corrupt_at`, from now)."""
        with self._lock:
            self.corrupt_at = self._offset + num_bytes

    def cancel_flip(self) -> None:
        with self._lock:
            self.corrupt_at = None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:  # shutdown first: it wakes a pump blocked in recv, close alone may not
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
