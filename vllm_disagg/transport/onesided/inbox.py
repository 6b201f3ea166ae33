# SPDX-License-Identifier: Apache-2.0
"""The receiver half shared by the one-sided backends (`rdma`, `mscclpp`): an authenticated
control listener whose connections only carry liveness, a poller thread that turns landed ring
slots into `Notification`s, and the hand-out of those notifications and of lost peers.

Subclasses supply `SERVICE`, `_welcome(hello) -> bytes`, `_poll_loop()`, `_drop(sid, why, lost)`
and `_session_id(hello)`. Pure python (the soft-RoCE VM runs it with Debian's python).
"""

from __future__ import annotations

import collections
import threading
import time

from vllm_disagg.errors import DisaggError, PeerLostError, TransportTimeout
from vllm_disagg.transport.base import KVReceiver, Notification, TransportOptions, TransportStats
from vllm_disagg.transport.server import AuthServer
from vllm_disagg.transport.wire import T_BYE, SockStream, read_frame


def backoff(idle_rounds: int) -> None:
    """Polling pace: spin-ish while busy, up to 1 ms sleeps when idle (2-core friendly)."""
    time.sleep(0 if idle_rounds < 20 else min(1e-3, 2e-5 * idle_rounds))


class OneSidedReceiver(KVReceiver):
    SERVICE = b""
    POLLER_NAME = "disagg-rx-poll"

    def __init__(self, options: TransportOptions, name: str):
        self.options, self.name = options, name
        self.stats = TransportStats()
        self._server: AuthServer | None = None
        self._peers: dict = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ready: collections.deque[Notification] = collections.deque()
        self._lost: list[str] = []
        self._closed = threading.Event()
        self._poller: threading.Thread | None = None

    def start(self) -> str:
        if self._server is None:
            o = self.options
            self._server = AuthServer(
                token=o.auth_token.encode(),
                service=self.SERVICE,
                serve=self._serve,
                welcome_info=self._welcome,
                stats=self.stats,
                timeout_s=o.timeout_s,
                host=o.host,
                port=o.port,
            )
            self._poller = threading.Thread(target=self._poll_loop, name=self.POLLER_NAME, daemon=True)
            self._poller.start()
        return self._server.address

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("call start() first")
        return self._server.address

    def _serve(self, stream: SockStream, hello: bytes) -> None:
        """Hold the control connection: its EOF is how a sender's death is noticed."""
        sid = self._session_id(hello)
        with self._lock:
            peer = self._peers.get(sid)
        if peer is None:
            return
        peer.stream = stream
        self._on_active(peer)
        while not self._closed.is_set() and not peer.dead:
            try:
                ftype, _, _ = read_frame(stream, timeout=0.5)
            except TransportTimeout:
                continue
            except DisaggError as err:
                self._drop(sid, f"control channel: {err}", lost=not self._closed.is_set())
                return
            if ftype == T_BYE:
                self._drop(sid, "said goodbye", lost=False)
                return
            self.stats.record_rejected()
            self._drop(sid, f"unexpected control frame type {ftype}", lost=True)
            return

    def _on_active(self, peer) -> None:
        """Hook: the peer's control connection is held (rdma starts polling it only now)."""

    def poll_notifications(self) -> list[Notification]:
        with self._lock:
            out = list(self._ready)
            self._ready.clear()
        return out

    def wait_notification(self, timeout: float | None = None) -> Notification:
        timeout = self.options.timeout_s if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._closed.is_set(), timeout):
                raise TransportTimeout(f"no KV notification within {timeout}s")
            if not self._ready:
                raise PeerLostError("receiver closed")
            return self._ready.popleft()

    def lost_peers(self) -> list[str]:
        with self._lock:
            out, self._lost = self._lost, []
        return out

    def _stop(self) -> list:
        """First half of close(): stop serving and polling; returns the peers to release."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.close()
        if self._poller is not None:
            self._poller.join(timeout=2)
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            p.dead = True
        return peers
