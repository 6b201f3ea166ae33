# SPDX-License-Identifier: Apache-2.0
"""Message channel over one RC QP pair: each side owns a receive ring in registered host memory
and WRITEs into the other's ring (body + seqword in one post), credits flowing back by WRITE.

A message is serialized exactly like the stream backends' MSG frame (`transport/msg.py`:
frame header + count + lengths + header, then the payload bytes) and cut into ring-slot
fragments, so big activations stream through a bounded ring. The sender copies into registered
staging slots (so any tensor can be sent without registering it); the receiver copies each
fragment straight into the caller's `out` buffers. Both directions poll with the CPU in the
calling thread: no helper threads, and every wait is bounded and watches the control socket.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.base import Message, MsgChannel, MsgListener, TransportOptions, TransportStats
from vllm_disagg.transport.msg import StreamMsgChannel, pack_msg, parse_msg_meta
from vllm_disagg.transport.rdma import proto
from vllm_disagg.transport.rdma.ring import CREDIT_WR_ID, CreditWord, RingReader, RingWriter
from vllm_disagg.transport.rdma.verbs import Device, Endpoint, wc_status_name
from vllm_disagg.transport.server import AuthServer
from vllm_disagg.transport.wire import (
    FRAME_HDR,
    T_MSG,
    SockStream,
    as_byte_view,
    check_frame_crc,
    client_handshake,
    connect_socket,
    parse_frame_header,
    read_frame,
)

logger = logging.getLogger(__name__)

SERVICE = b"rdma-msg"
MSG_SLOTS = 8
_READY = b"RDMA-READY"
_PEER_CHECK_S = 0.05


def slot_bytes_for(options: TransportOptions) -> int:
    """Ring slot size: `chunk_bytes` clamped to [128 KiB, 16 MiB] (fits a full 64 KiB header)."""
    return max(128 << 10, min(options.chunk_bytes, 16 << 20))


class _Side:
    """This process's half of a channel: its QP, its receive ring, its writer into the peer."""

    def __init__(self, dev: Device, options: TransportOptions):
        self.ep = Endpoint(dev, max_send_wr=4 * MSG_SLOTS)
        self.reader = RingReader(dev, MSG_SLOTS, slot_bytes_for(options))
        self.credit = CreditWord(dev)
        self.writer: RingWriter | None = None

    def info(self) -> proto.QpInfo:
        return self.ep.info(**self.reader.fields(), **self.credit.fields())

    def connect(self, dev: Device, remote: proto.QpInfo) -> None:
        if not remote.credit_rkey or remote.slot_bytes < FRAME_HDR.size + proto.FRAG_HEAD.size + 64:
            raise ProtocolError("rdma msg peer announced no credit word or a tiny ring")
        self.writer = RingWriter(dev, remote, self.credit)
        self.remote = remote
        self.ep.connect(remote)

    def close(self) -> None:
        self.ep.to_error()
        self.ep.close()
        self.reader.close()
        if self.writer is not None:
            self.writer.close()
        self.credit.close()


class RdmaMsgChannel(MsgChannel):
    def __init__(self, side: _Side, stream: SockStream, options: TransportOptions):
        self._side, self._stream, self.options = side, stream, options
        self.stats = TransportStats()
        self._send_seq = 0
        self._recv_seq = 0
        self._pending_wrs = 0
        self._broken: DisaggError | None = None
        self._closed = False
        self._lock = threading.Lock()

    # ---- send ----------------------------------------------------------------------------------
    def send(self, header: bytes, tensors: Sequence[Any] = (), timeout: float | None = None) -> None:
        self._check()
        views = [as_byte_view(t) for t in tensors]
        frame, payload = pack_msg(bytes(header), views)
        total = len(frame) + payload
        if payload > self.options.max_msg_bytes:
            raise ValueError(f"message of {payload} bytes exceeds max_msg_bytes={self.options.max_msg_bytes}")
        deadline = self._deadline(timeout)
        t0 = time.perf_counter()
        try:
            self._send_stream([memoryview(frame), *views], total, deadline)
        except DisaggError as err:
            self._break(err)
            raise
        self.stats.record_op(total, time.perf_counter() - t0)

    def _send_stream(self, parts: list[memoryview], total: int, deadline: float) -> None:
        w = self._side.writer
        cap = w.slot_bytes - proto.FRAG_HEAD.size
        msg_seq, self._send_seq = self._send_seq, self._send_seq + 1
        part, pos, off = 0, 0, 0
        while off < total:
            self._wait(
                lambda: w.has_room() and self._pending_wrs + 2 <= self._side.ep.max_send_wr - 2,
                deadline,
                "ring credit",
            )
            body, n = w.body(), min(cap, total - off)
            proto.FRAG_HEAD.pack_into(body, 0, msg_seq, total, off, n)
            filled = proto.FRAG_HEAD.size
            while filled < proto.FRAG_HEAD.size + n:  # copy the next n bytes of the parts
                k = min(parts[part].nbytes - pos, proto.FRAG_HEAD.size + n - filled)
                body[filled : filled + k] = parts[part][pos : pos + k]
                filled, pos = filled + k, pos + k
                if pos == parts[part].nbytes:
                    part, pos = part + 1, 0
            with self._lock:  # send and recv may run in different threads: one poster at a time
                self._side.ep.post_writes(w.writes(filled), w.next_seq - 1)
                self._pending_wrs += 2
            off += n

    # ---- recv ----------------------------------------------------------------------------------
    def recv(self, out: Sequence[Any] | None = None, timeout: float | None = None) -> Message:
        self._check()
        deadline = self._deadline(timeout)
        try:
            return self._recv(out, deadline)
        except (DisaggError, ValueError) as err:
            if isinstance(err, DisaggError) and not isinstance(err, TransportTimeout):
                self._break(err)
            raise

    def _recv(self, out: Sequence[Any] | None, deadline: float) -> Message:
        first = self._next_fragment(deadline)
        msg_seq, total, off, n = proto.FRAG_HEAD.unpack_from(first)
        if (
            msg_seq != self._recv_seq
            or off != 0
            or n < FRAME_HDR.size
            or total > self.options.max_msg_bytes + (1 << 20)
        ):
            raise ProtocolError(
                f"rdma msg from {self._stream.peer}: bad first fragment (seq {msg_seq}, off {off}, len {n})"
            )
        self._recv_seq += 1
        data = first[proto.FRAG_HEAD.size : proto.FRAG_HEAD.size + n]
        ftype, meta_len, payload_len = parse_frame_header(data[: FRAME_HDR.size], self._stream.peer)
        meta_end = FRAME_HDR.size + meta_len
        if ftype != T_MSG or meta_end > n or meta_end + payload_len != total:
            raise ProtocolError(f"rdma msg from {self._stream.peer}: frame type {ftype}, sizes inconsistent")
        meta = bytes(data[FRAME_HDR.size : meta_end])
        check_frame_crc(data[: FRAME_HDR.size], meta, self._stream.peer)
        header, lengths = parse_msg_meta(meta, payload_len, self.options.max_msg_bytes, self._stream.peer)
        dsts = StreamMsgChannel._destinations(out, lengths)
        sink = _Sink(dsts if dsts is not None else [], skip=dsts is None)
        sink.feed(data[meta_end:])
        got = n
        self._consume()
        while got < total:
            frag = self._next_fragment(deadline)
            seq2, total2, off2, n2 = proto.FRAG_HEAD.unpack_from(frag)
            if seq2 != msg_seq or total2 != total or off2 != got or not 0 < n2 <= total - got:
                raise ProtocolError(f"rdma msg from {self._stream.peer}: fragment out of order")
            sink.feed(frag[proto.FRAG_HEAD.size : proto.FRAG_HEAD.size + n2])
            got += n2
            self._consume()
        self.stats.record_received(total)
        if dsts is None:
            raise ValueError(f"recv(out=...) buffers too small or too few for payload lengths {lengths}")
        return Message(header=header, buffers=dsts)

    def _next_fragment(self, deadline: float) -> memoryview:
        r = self._side.reader
        body: list[memoryview] = []

        def ready() -> bool:
            v = r.peek()
            if v is not None:
                body.append(v)
            return v is not None

        self._wait(ready, deadline, "message")
        return body[0]

    def _consume(self) -> None:
        side = self._side
        side.reader.consume()
        with self._lock:
            if side.reader.return_credits(side.ep, side.remote):
                self._pending_wrs += 1

    # ---- shared ---------------------------------------------------------------------------------
    def _wait(self, cond, deadline: float, what: str) -> None:
        """Poll `cond` (and the CQ) until true; bounded, and a closed peer ends it."""
        idle, next_check = 0, 0.0
        while True:
            self._reap()
            if cond():
                return
            now = time.monotonic()
            if now > deadline:
                raise TransportTimeout(f"no {what} from {self._stream.peer} in time")
            if now >= next_check:
                next_check = now + _PEER_CHECK_S
                if self._stream.peer_closed():
                    raise PeerLostError(f"rdma msg peer {self._stream.peer} closed the channel")
            idle += 1
            time.sleep(0 if idle < 50 else min(1e-3, 2e-5 * idle))

    def _reap(self) -> None:
        with self._lock:
            done = self._side.ep.poll(32)
            for wr_id, _ in done:
                self._pending_wrs -= 1 if wr_id == CREDIT_WR_ID else 2
        for _, status in done:
            if status:
                raise PeerLostError(f"RDMA WRITE to {self._stream.peer} failed: {wc_status_name(status)}")

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self.options.timeout_s if timeout is None else timeout)

    def _check(self) -> None:
        if self._closed:
            raise PeerLostError("channel is closed")
        if self._broken is not None:
            raise type(self._broken)(f"channel is broken: {self._broken}")

    def _break(self, err: DisaggError) -> None:
        self._broken = self._broken or err
        self._side.ep.to_error()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stream.close()
        self._side.close()


class _Sink:
    """Scatters a byte stream into the destination views in order (or drops it)."""

    def __init__(self, dsts: list[memoryview], skip: bool):
        self.dsts, self.skip, self.i, self.pos = dsts, skip, 0, 0

    def feed(self, data: memoryview) -> None:
        if self.skip:
            return
        off = 0
        while off < data.nbytes:
            while self.dsts[self.i].nbytes == self.pos:
                self.i, self.pos = self.i + 1, 0
            k = min(data.nbytes - off, self.dsts[self.i].nbytes - self.pos)
            self.dsts[self.i][self.pos : self.pos + k] = data[off : off + k]
            self.pos, off = self.pos + k, off + k


class RdmaMsgListener(MsgListener):
    def __init__(self, options: TransportOptions):
        self.options = options
        self.stats = TransportStats()
        self._dev = Device.get()
        self._pending: dict[bytes, _Side] = {}
        self._ready: queue.Queue[RdmaMsgChannel] = queue.Queue()
        self._lock = threading.Lock()
        self._server = AuthServer(
            token=options.auth_token.encode(),
            service=SERVICE,
            serve=self._serve,
            welcome_info=self._welcome,
            stats=self.stats,
            timeout_s=options.timeout_s,
            host=options.host,
            port=options.port,
        )

    @property
    def address(self) -> str:
        return self._server.address

    def _welcome(self, hello: bytes) -> bytes:
        session_id, name, remote = proto.parse_hello(hello, "rdma msg client")
        side = _Side(self._dev, self.options)
        try:
            side.connect(self._dev, remote)
        except Exception as err:
            side.close()
            raise ProtocolError(f"cannot connect a QP to msg client {name!r}: {err}") from None
        with self._lock:
            self._pending[session_id] = side
        return side.info().pack()

    def _serve(self, stream: SockStream, hello: bytes) -> None:
        with self._lock:
            side = self._pending.pop(hello[: proto.SESSION_ID_BYTES], None)
        if side is None:
            return
        try:  # the client says READY once its QP is RTR, so our first WRITE is never dropped
            ftype, meta, _ = read_frame(stream)
            if ftype != T_MSG or bytes(meta) != _READY:
                raise ProtocolError(f"expected READY from {stream.peer}, got frame type {ftype}")
        except DisaggError as err:
            logger.warning("rdma msg client %s dropped during setup: %s", stream.peer, err)
            side.close()
            stream.close()
            return
        self._server.forget(stream.sock)
        self._ready.put(RdmaMsgChannel(side, stream, self.options))

    def accept(self, timeout: float | None = None) -> RdmaMsgChannel:
        timeout = self.options.timeout_s if timeout is None else timeout
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(
                f"no rdma msg client connected to {self.address} within {timeout}s"
            ) from None

    def close(self) -> None:
        self._server.close()
        with self._lock:
            sides, self._pending = list(self._pending.values()), {}
        for s in sides:
            s.close()


def connect_msg(options: TransportOptions, address: str, timeout: float | None = None) -> RdmaMsgChannel:
    from vllm_disagg.transport.wire import pack_frame

    timeout = options.timeout_s if timeout is None else timeout
    dev = Device.get()
    stream = SockStream(connect_socket(address, timeout), address, timeout)
    side = _Side(dev, options)
    try:
        hello = proto.pack_hello(os.urandom(proto.SESSION_ID_BYTES), f"msg-{os.getpid()}", side.info())
        welcome = client_handshake(stream, options.auth_token.encode(), SERVICE, hello)
        remote, end = proto.QpInfo.unpack_from(welcome, 0, address)
        if end != len(welcome):
            raise ProtocolError(f"rdma msg welcome from {address}: {len(welcome) - end} trailing bytes")
        side.connect(dev, remote)
        stream.send_parts([pack_frame(T_MSG, _READY)])
    except BaseException:
        side.close()
        stream.close()
        raise
    stream.timeout = options.timeout_s
    return RdmaMsgChannel(side, stream, options)
