# SPDX-License-Identifier: Apache-2.0
"""`nixl` backend: NIXL 1.5.1 over UCX (DRAM here, VRAM on GPUs; the PyPI wheel carries UCX with
verbs, so the same code drives RDMA NICs). KV push = one-sided WRITE + notification (`kv_rx.py`, `kv_tx.py`);
messages = WRITE into peer slots + notifications (`msg.py`); both use an authenticated TCP control
channel for metadata exchange and liveness. Selecting it where nixl does not import raises
TransportUnavailable naming what is missing; there is no fallback.

KV push (`kv_rx.py`, `kv_tx.py`): the sender's hello on the control channel (service "nixl-kv") is
its NIXL agent name; the receiver's welcome carries the region table, base addresses and its agent
metadata, and only authenticated agent names are accepted as notification sources. The socket
stays open: EOF means the peer is gone; BYE carries the number of writes issued, and notifications
still behind it are accepted until that many arrived (else the sender is lost after timeout_s).
"""

from __future__ import annotations

import os
import threading

from vllm_disagg.transport.base import KVReceiver, KVSender, MsgChannel, MsgListener, Transport, TransportKind
from vllm_disagg.transport.nixl.agent import import_reason

__all__ = ["NixlTransport"]


class NixlMsgListener(MsgListener):
    def __init__(self, options):
        import queue

        from vllm_disagg.transport.base import TransportStats
        from vllm_disagg.transport.nixl.msg import SERVICE, NixlEndpoint
        from vllm_disagg.transport.server import AuthServer

        self.options, self.stats = options, TransportStats()
        self._ready: queue.Queue = queue.Queue()
        self._local = threading.local()

        def welcome(hello: bytes) -> bytes:
            self._local.ep = NixlEndpoint(options.host)  # same handler thread runs serve() next
            return self._local.ep.describe()

        self._server = AuthServer(
            token=options.auth_token.encode(),
            service=SERVICE,
            serve=self._serve,
            welcome_info=welcome,
            stats=self.stats,
            timeout_s=options.timeout_s,
            host=options.host,
            port=options.port,
        )

    def _serve(self, stream, hello: bytes) -> None:
        from vllm_disagg.transport.nixl.msg import NixlMsgChannel

        self._server.forget(stream.sock)
        self._ready.put(NixlMsgChannel(self._local.ep, stream, hello, self.options))

    @property
    def address(self) -> str:
        return self._server.address

    def accept(self, timeout: float | None = None) -> MsgChannel:
        import queue

        from vllm_disagg.errors import TransportTimeout

        timeout = self.options.timeout_s if timeout is None else timeout
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no client connected to {self.address} within {timeout}s") from None

    def close(self) -> None:
        self._server.close()


class NixlTransport(Transport):
    kind = TransportKind.NIXL
    _reason: str | None = None
    _probed = False

    @classmethod
    def doctor_note(cls) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"nixl {version('nixl')}, UCX backend; UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', '<all>')}"
        except PackageNotFoundError:
            return "nixl"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not cls._probed:
            cls._reason, cls._probed = import_reason(), True
        return cls._reason

    def kv_receiver(self, name: str = "receiver") -> KVReceiver:
        from vllm_disagg.transport.nixl.kv_rx import NixlKVReceiver

        return NixlKVReceiver(self.options, name)

    def kv_sender(self, name: str = "sender") -> KVSender:
        from vllm_disagg.transport.nixl.kv_tx import NixlKVSender

        return NixlKVSender(self.options, name)

    def listen_msg(self) -> MsgListener:
        return NixlMsgListener(self.options)

    def connect_msg(self, address: str, timeout: float | None = None) -> MsgChannel:
        from vllm_disagg.transport.nixl.msg import SERVICE, NixlEndpoint, NixlMsgChannel
        from vllm_disagg.transport.wire import SockStream, client_handshake, connect_socket

        timeout = self.options.timeout_s if timeout is None else timeout
        ep = NixlEndpoint(self.options.host)
        stream = SockStream(connect_socket(address, timeout), address, timeout)
        try:
            info = client_handshake(stream, self.options.auth_token.encode(), SERVICE, ep.describe())
            return NixlMsgChannel(ep, stream, info, self.options)
        except BaseException:
            stream.close()
            raise
