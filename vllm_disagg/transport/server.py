# SPDX-License-Identifier: Apache-2.0
"""An authenticated accept loop shared by every listener (tcp and shm KV receivers, msg listeners,
the nixl control channel).

Each connection gets a thread: the HMAC handshake (bounded by `handshake_timeout_s`), then
`serve(stream, hello)`. A client that sends garbage, fails auth or stalls is logged, told why
(ERROR frame, best effort) and dropped; the listener keeps serving everyone else. At most
`MAX_PENDING_HANDSHAKES` connections may be in their handshake at once: past it a new one is closed
at once, so silent strangers (slowloris) cannot pile up threads.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

from vllm_disagg.errors import DisaggError
from vllm_disagg.transport.base import TransportStats
from vllm_disagg.transport.wire import SockStream, send_error, server_handshake

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64
_ACCEPT_POLL_S = 0.2


class AuthServer:
    """Listen on tcp `host:port` (unix=False) or an abstract unix socket (unix=True)."""

    def __init__(
        self,
        *,
        token: bytes,
        service: bytes,
        serve: Callable[[SockStream, bytes], None],
        welcome_info: Callable[[bytes], bytes] = lambda hello: b"",
        stats: TransportStats,
        timeout_s: float,
        host: str = "127.0.0.1",
        port: int = 0,
        unix: bool = False,
    ):
        self._token, self._service = token, service
        self._serve, self._welcome_info = serve, welcome_info
        self._stats, self._timeout_s = stats, timeout_s
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._num_pending = 0  # connections still in their handshake
        self.sock, self.address = _bind(host, port, unix, service)
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"disagg-{service.decode()}-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        self.sock.settimeout(_ACCEPT_POLL_S)
        while not self._closed.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # closed under us
            with self._lock:
                full = self._num_pending >= MAX_PENDING_HANDSHAKES
                if not full:
                    self._num_pending += 1
                    self._conns.add(conn)
            if full:
                self._stats.record_rejected()
                conn.close()
                continue
            if conn.family == socket.AF_INET:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else f"{self.address}(client)"
            threading.Thread(target=self._handle, args=(conn, peer), name="disagg-conn", daemon=True).start()

    def _handle(self, conn: socket.socket, peer: str) -> None:
        stream = SockStream(conn, peer, min(self._timeout_s, HANDSHAKE_TIMEOUT_S))
        try:
            try:
                hello = server_handshake(stream, self._token, self._service, self._welcome_info)
            except DisaggError as err:
                self._stats.record_rejected()
                logger.warning("rejected connection from %s on %s: %s", peer, self.address, err)
                send_error(stream, err)
                stream.close()
                return
            finally:
                with self._lock:
                    self._num_pending -= 1
            stream.timeout = self._timeout_s
            self._serve(stream, hello)
        except Exception:
            logger.exception("transport connection handler for %s failed", peer)
        finally:
            with self._lock:
                self._conns.discard(conn)

    def forget(self, conn: socket.socket) -> None:
        """The serve callback took ownership of a connection (it outlives its handler thread)."""
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass
        self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)


def _bind(host: str, port: int, unix: bool, service: bytes) -> tuple[socket.socket, str]:
    if unix:
        name = f"vllm-disagg-{service.decode()}-{os.getpid()}-{os.urandom(6).hex()}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + name)
        address = "@" + name
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        address = f"{host}:{sock.getsockname()[1]}"
    sock.listen(128)
    return sock, address
