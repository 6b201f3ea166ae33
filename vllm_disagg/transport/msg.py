# SPDX-License-Identifier: Apache-2.0
"""The message channel over any byte stream (a TCP socket, or an shm ring pair).

A message is one MSG frame: meta = u16 count + u64 length per tensor + the caller's header bytes;
payload = the tensors' raw bytes back to back, sent with one sendmsg (or ring write) straight
from tensor memory and received straight into the caller's buffers.
"""

from __future__ import annotations

import functools
import logging
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.base import Message, MsgChannel, MsgListener, TransportOptions, TransportStats
from vllm_disagg.transport.server import AuthServer
from vllm_disagg.transport.wire import (
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    T_BYE,
    T_MSG,
    SockStream,
    as_byte_view,
    frame_head,
    pack_frame,
    read_frame,
)

logger = logging.getLogger(__name__)
_COUNT = struct.Struct("<H")
_DRAIN_CHUNK = 1 << 20


@functools.lru_cache(maxsize=MAX_TENSORS + 1)
def _lengths_struct(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")


@functools.lru_cache(maxsize=MAX_TENSORS + 1)
def _msg_meta_struct(count: int) -> struct.Struct:
    """Tensor count + lengths in one struct: one pack per message (hot path)."""
    return struct.Struct(f"<H{count}Q")


def pack_msg(header: bytes, views: Sequence[memoryview]) -> tuple[bytes, int]:
    count = len(views)
    if len(header) > MAX_HEADER_BYTES or count > MAX_TENSORS:
        raise ValueError(f"message header must be <= {MAX_HEADER_BYTES} bytes and <= {MAX_TENSORS} tensors")
    lengths = [v.nbytes for v in views]
    total = sum(lengths)
    meta = _msg_meta_struct(count).pack(count, *lengths) + header
    return frame_head(T_MSG, meta, total) + meta, total


def parse_msg_meta(
    meta: bytes | bytearray, payload_len: int, max_bytes: int, peer: str
) -> tuple[bytes, list[int]]:
    if len(meta) < _COUNT.size:
        raise ProtocolError(f"MSG frame from {peer} too short ({len(meta)} meta bytes)")
    (count,) = _COUNT.unpack_from(meta)
    end = _COUNT.size + 8 * count
    if count > MAX_TENSORS or len(meta) < end or len(meta) - end > MAX_HEADER_BYTES:
        raise ProtocolError(f"MSG frame from {peer}: bad tensor count {count} or header size")
    lengths = list(_lengths_struct(count).unpack_from(meta, _COUNT.size))
    if sum(lengths) != payload_len or payload_len > max_bytes:
        raise ProtocolError(
            f"MSG frame from {peer}: payload {payload_len} != sum of lengths {sum(lengths)} or > {max_bytes}"
        )
    return bytes(meta[end:]), lengths


class StreamMsgChannel(MsgChannel):
    """One message channel; `stream` has send_parts/recv_into/recv_exact/close like SockStream."""

    def __init__(self, stream: Any, options: TransportOptions, on_close: Callable[[], None] | None = None):
        self.stream = stream
        self.options = options
        self.stats = TransportStats()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._broken: DisaggError | None = None
        self._on_close = on_close
        self._closed = False

    def send(self, header: bytes, tensors: Sequence[Any] = (), timeout: float | None = None) -> None:
        views = [as_byte_view(t) for t in tensors]
        frame, nbytes = pack_msg(header, views)
        with self._send_lock:
            self._check()
            try:
                self.stream.send_parts([frame, *views], timeout)
            except DisaggError as err:
                self._broken = err
                raise
        self.stats.record_op(nbytes, 0.0)

    def recv(self, out: Sequence[Any] | None = None, timeout: float | None = None) -> Message:
        with self._recv_lock:
            self._check()
            try:
                return self._recv(out, timeout)
            except (PeerLostError, ProtocolError) as err:
                self._broken = err
                raise

    def _recv(self, out: Sequence[Any] | None, timeout: float | None) -> Message:
        ftype, meta, payload_len = read_frame(self.stream, timeout)
        if ftype == T_BYE:
            raise PeerLostError(f"{self.stream.peer} closed the channel")
        if ftype != T_MSG:
            raise ProtocolError(f"expected MSG from {self.stream.peer}, got frame type {ftype}")
        header, lengths = parse_msg_meta(meta, payload_len, self.options.max_msg_bytes, self.stream.peer)
        dsts = self._destinations(out, lengths)
        if dsts is None:
            self._drain(payload_len, timeout)
            raise ValueError(f"recv(out=...) buffers too small or too few for payload lengths {lengths}")
        for dst in dsts:
            self.stream.recv_into(dst, timeout)
        self.stats.record_received(payload_len)
        return Message(header=header, buffers=dsts)

    @staticmethod
    def _destinations(out: Sequence[Any] | None, lengths: list[int]) -> list[memoryview] | None:
        if out is None:
            return [memoryview(bytearray(n)) for n in lengths]
        if len(out) < len(lengths):
            return None
        dsts = []
        for o, n in zip(out, lengths):
            v = as_byte_view(o)
            if v.nbytes < n or v.readonly:
                return None
            dsts.append(v if v.nbytes == n else v[:n])
        return dsts

    def _drain(self, nbytes: int, timeout: float | None) -> None:
        scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
        while nbytes:
            k = min(nbytes, scratch.nbytes)
            self.stream.recv_into(scratch[:k], timeout)
            nbytes -= k

    def _check(self) -> None:
        if self._closed:
            raise PeerLostError("channel is closed")
        if self._broken is not None:
            raise type(self._broken)(f"channel is broken: {self._broken}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with self._send_lock:
                self.stream.send_parts([pack_frame(T_BYE)], 0.5)
        except Exception:  # best effort goodbye; the peer may be gone
            pass
        self.stream.close()
        if self._on_close:
            self._on_close()


class SockMsgListener(MsgListener):
    """Message listener over tcp; `make_channel(stream, hello)` lets shm wrap the socket."""

    def __init__(self, options: TransportOptions, unix: bool = False, make_channel=None):
        self.options = options
        self.stats = TransportStats()
        self._ready: queue.Queue[MsgChannel] = queue.Queue()
        self._make = make_channel or (lambda stream, hello: StreamMsgChannel(stream, options))
        self._server = AuthServer(
            token=options.auth_token.encode(),
            service=b"msg",
            serve=self._serve,
            stats=self.stats,
            timeout_s=options.timeout_s,
            host=options.host,
            port=options.port,
            unix=unix,
        )

    @property
    def address(self) -> str:
        return self._server.address

    def _serve(self, stream: SockStream, hello: bytes) -> None:
        try:
            channel = self._make(stream, hello)
        except DisaggError as err:
            logger.warning("message channel setup with %s failed: %s", stream.peer, err)
            stream.close()
            return
        self._server.forget(stream.sock)
        self._ready.put(channel)

    def accept(self, timeout: float | None = None) -> MsgChannel:
        timeout = self.options.timeout_s if timeout is None else timeout
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no client connected to {self.address} within {timeout}s") from None

    def close(self) -> None:
        self._server.close()
