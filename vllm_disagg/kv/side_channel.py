# SPDX-License-Identifier: Apache-2.0
"""Request/reply side channel of the KV push, on `vllm_disagg.transport` message channels.

`SideChannelServer` (prefill worker) accepts authenticated channels on `kv.kv_port` and answers
each message with `handler(payload, peer) -> reply | None` on a thread per channel; a malformed
message is logged and dropped, and the server keeps serving. `SideChannelClient` (decode worker)
keeps one channel per prefill address and does bounded `call`s on it, one at a time.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport import MsgChannel, MsgListener

__all__ = ["SideChannelServer", "SideChannelClient", "call_once"]

logger = init_logger(__name__)
_IDLE_RECV_S = 60.0


class SideChannelServer:
    def __init__(self, listener: MsgListener, handler: Callable[[bytes, str], bytes | None]):
        self._listener = listener
        self._handler = handler
        self._stop = threading.Event()
        self._channels: list[Any] = []
        self.address: str = listener.address
        threading.Thread(target=self._accept_loop, name="disagg-kv-side-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                channel = self._listener.accept(timeout=0.5)
            except TransportTimeout:
                continue
            except (DisaggError, OSError) as err:
                if self._stop.is_set():
                    return
                logger.warning("KV side channel: accept failed: %s", err)
                continue
            self._channels.append(channel)
            threading.Thread(target=self._serve, args=(channel,), name="disagg-kv-side", daemon=True).start()

    def _serve(self, channel: MsgChannel) -> None:
        peer = str(getattr(getattr(channel, "stream", None), "peer", None) or "a decode worker")
        while not self._stop.is_set():
            try:
                msg = channel.recv(timeout=_IDLE_RECV_S)
            except TransportTimeout:
                continue
            except (PeerLostError, OSError):
                break
            except DisaggError as err:
                logger.warning("KV side channel: bad frame from %s: %s", peer, err)
                break
            if not self._answer(channel, msg.header, peer):
                break
        self._close(channel)
        try:
            self._channels.remove(channel)
        except ValueError:
            pass

    def _answer(self, channel: MsgChannel, payload: bytes, peer: str) -> bool:
        try:
            reply = self._handler(bytes(payload), peer)
        except ProtocolError as err:
            logger.warning("KV side channel: rejected message from %s: %s", peer, err)
            return True
        try:
            if reply is not None:
                channel.send(reply)
        except (DisaggError, OSError) as err:
            logger.warning("KV side channel: reply to %s failed: %s", peer, err)
            return False
        return True

    @staticmethod
    def _close(channel: MsgChannel) -> None:
        try:
            channel.close()
        except (DisaggError, OSError):
            pass

    def close(self) -> None:
        self._stop.set()
        for channel in self._channels:
            self._close(channel)
        try:
            self._listener.close()
        except (DisaggError, OSError):
            pass


class SideChannelClient:
    def __init__(self, connect: Callable[[str, float], Any]):
        self._connect = connect
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[Any, threading.Lock]] = {}

    def _channel(self, address: str, timeout: float) -> tuple[Any, threading.Lock]:
        with self._lock:
            entry = self._channels.get(address)
        if entry is None:
            entry = (self._connect(address, timeout), threading.Lock())
            with self._lock:
                entry = self._channels.setdefault(address, entry)
        return entry

    def call(self, address: str, payload: bytes, timeout: float) -> bytes:
        """Send one message and return the reply; one reconnect if a cached channel went stale (closed,
        reset), none after a timeout."""
        try:
            return self._call_once(address, payload, timeout)
        except TimeoutError:
            raise  # a peer that does not answer in time (frozen, overloaded): a retry would double the wait
        except (PeerLostError, OSError):
            return self._call_once(address, payload, timeout)

    def _call_once(self, address: str, payload: bytes, timeout: float) -> bytes:
        channel, lock = self._channel(address, timeout)
        try:
            with lock:
                channel.send(payload, timeout=timeout)
                return bytes(channel.recv(timeout=timeout).header)
        except (DisaggError, OSError):
            self.drop(address)  # a late reply must never answer the next call
            raise

    def closed_by_peer(self, address: str) -> bool:
        """True when the peer closed the idle channel to `address` (EOF or its goodbye frame).

        The channel is request/reply under its lock, so with no call in flight nothing may arrive
        on it: readable then means closed. A channel busy with a call is left alone (that call
        sees the loss itself)."""
        with self._lock:
            entry = self._channels.get(address)
        sock = getattr(getattr(entry[0], "stream", None), "sock", None) if entry else None
        if sock is None or not entry[1].acquire(blocking=False):
            return False
        try:
            poller = select.poll()  # not select(): no FD_SETSIZE limit
            poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # dropped by our side meanwhile: the next call reconnects
            return False
        finally:
            entry[1].release()

    def drop(self, address: str) -> None:
        with self._lock:
            entry = self._channels.pop(address, None)
        if entry is not None:
            SideChannelServer._close(entry[0])

    def close(self) -> None:
        for address in list(self._channels):
            self.drop(address)


def call_once(connect: Callable[[str, float], Any], address: str, payload: bytes, timeout: float) -> bytes:
    """One message and its reply on a channel of its own, closed after: a CANCEL from the router, or
    one a prefill instance's rank 0 passes on to its other ranks."""
    channel = connect(address, timeout)
    try:
        channel.send(payload, timeout=timeout)
        return bytes(channel.recv(timeout=timeout).header)
    finally:
        SideChannelServer._close(channel)
