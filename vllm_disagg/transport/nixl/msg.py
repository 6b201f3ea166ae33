# SPDX-License-Identifier: Apache-2.0
"""Message channel over NIXL: each side registers `NUM_SLOTS` receive slots; a send WRITEs the
framed message (the same MSG frame as tcp/shm) into the peer's next slot with a notif
("D", seq, slot, size); the receiver validates the frame in place, copies the payloads into the
caller's buffers and returns a credit notif ("C", slot). Setup and liveness use an authenticated
TCP control socket (service "nixl-msg") that stays open: EOF means the peer is gone.

Hot path as raw NIXL runs it: a transfer handle per (slot, size) is made once and re-posted
(`transfer(handle, notif)`), and waits poll without sleeping while the channel is busy
(`agent.Poller`). Limit: one message (frame + payloads) must fit a slot (`SLOT_BYTES`).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from vllm_disagg.errors import PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.transport.base import Message, MsgChannel, TransportOptions, TransportStats
from vllm_disagg.transport.msg import pack_msg, parse_msg_meta
from vllm_disagg.transport.nixl.agent import Poller, make_agent, nixl_errors, park_agent, release_agent
from vllm_disagg.transport.wire import (
    FRAME_HDR,
    T_MSG,
    SockStream,
    as_byte_view,
    check_frame_crc,
    parse_frame_header,
)

logger = logging.getLogger(__name__)
SERVICE = b"nixl-msg"
NUM_SLOTS = 2
SLOT_BYTES = 16 << 20
_ENDPOINT = struct.Struct("<QII")  # recv buffer address, slot bytes, num slots; then agent metadata
_DATA = struct.Struct("<cQII")  # b"D", seq, slot, size
_CREDIT = struct.Struct("<cI")  # b"C", slot
_LIVENESS_EVERY_S = 0.01
_DRIVE_AFTER_SEND_S = 0.005
_YIELD_S, _MAX_NAP_S = 0.5, 0.0002  # a waiting recv/send polls hard: it has nothing else to do
MAX_HANDLES = 64  # prepared WRITE handles kept per channel, keyed by (slot, size), LRU


class NixlEndpoint:
    """This side's agent and registered buffers, created before the handshake."""

    def __init__(self, host: str):
        import torch

        self.agent, self.name = make_agent("msg", host)
        self.recv_buf = torch.zeros(NUM_SLOTS * SLOT_BYTES, dtype=torch.uint8)
        self.send_buf = torch.zeros(NUM_SLOTS * SLOT_BYTES, dtype=torch.uint8)
        self.reg = self.agent.register_memory([self.recv_buf, self.send_buf])

    def describe(self) -> bytes:
        return (
            _ENDPOINT.pack(self.recv_buf.data_ptr(), SLOT_BYTES, NUM_SLOTS) + self.agent.get_agent_metadata()
        )


def parse_endpoint(raw: bytes, peer: str) -> tuple[int, bytes]:
    if len(raw) <= _ENDPOINT.size:
        raise ProtocolError(f"nixl-msg endpoint info from {peer} too short")
    addr, slot_bytes, slots = _ENDPOINT.unpack_from(raw)
    if slot_bytes != SLOT_BYTES or slots != NUM_SLOTS:
        raise ProtocolError(
            f"nixl-msg peer {peer} uses {slots}x{slot_bytes} slots, we use {NUM_SLOTS}x{SLOT_BYTES}"
        )
    return addr, raw[_ENDPOINT.size :]


class NixlMsgChannel(MsgChannel):
    def __init__(self, ep: NixlEndpoint, stream: SockStream, peer_info: bytes, options: TransportOptions):
        self.options, self.stats = options, TransportStats()
        self._ep, self._stream = ep, stream
        self._remote_addr, metadata = parse_endpoint(peer_info, stream.peer)
        self._remote = ep.agent.add_remote_agent(metadata)
        if isinstance(self._remote, bytes):
            self._remote = self._remote.decode()
        self._lock = threading.RLock()  # the agent is driven by one thread at a time
        self._credits = NUM_SLOTS
        self._tx_seq = self._rx_seq = 0
        self._inbox: dict[int, tuple[int, int]] = {}
        self._handles: OrderedDict[tuple[int, int], Any] = OrderedDict()  # (slot, size) -> handle
        self._pending: dict[int, Any] = {}  # slot -> posted WRITE not yet seen DONE
        self._send_view = memoryview(ep.send_buf.numpy())
        self._recv_view = memoryview(ep.recv_buf.numpy())
        self._poller = Poller(options.spin_us * 1e-6, yield_s=_YIELD_S, max_nap_s=_MAX_NAP_S)
        self._next_liveness = 0.0
        self._closed = self._failed = False

    # Sending

    def send(self, header: bytes, tensors: Sequence[Any] = (), timeout: float | None = None) -> None:
        if self._closed:
            raise PeerLostError("channel is closed")
        views = [as_byte_view(t) for t in tensors]
        frame, nbytes = pack_msg(header, views)
        total = len(frame) + nbytes
        if total > SLOT_BYTES:
            raise ValueError(f"nixl message of {total} bytes exceeds the {SLOT_BYTES}-byte slot")
        deadline = time.monotonic() + (self.options.timeout_s if timeout is None else timeout)
        with self._lock, nixl_errors(self._stream.peer):
            self._wait(lambda: self._credits > 0, deadline, "a free slot at the peer")
            slot = self._tx_seq % NUM_SLOTS
            off = slot * SLOT_BYTES
            for part in (memoryview(frame), *views):
                self._send_view[off : off + part.nbytes] = part
                off += part.nbytes
            self._write(slot, total, _DATA.pack(b"D", self._tx_seq, slot, total), deadline)
            self._credits -= 1
            self._tx_seq += 1
        self.stats.record_op(nbytes, 0.0)

    def _write(self, slot: int, size: int, notif: bytes, deadline: float) -> None:
        """Post the WRITE and return; completion is polled by `_pump` (the staging slot is not
        reused before the peer's credit, which it sends only after the data landed)."""
        self._wait(lambda: slot not in self._pending, deadline, "the previous WRITE from this slot")
        xh = self._handle(slot, size)
        self._pending[slot] = xh
        if self._ep.agent.transfer(xh, notif) == "ERR":
            raise PeerLostError(f"nixl WRITE to {self._stream.peer} failed to start")
        # Without a progress thread only our polling moves the WRITE: drive it briefly here so a
        # caller that goes off computing after send() does not stall the peer.
        until = time.perf_counter() + _DRIVE_AFTER_SEND_S
        while self._pending and time.perf_counter() < until:
            self._poll_pending()

    def _handle(self, slot: int, size: int) -> Any:
        """The WRITE handle of `size` bytes from our send slot into the peer's receive slot, made
        once and re-posted (messages of one shape repeat every step)."""
        key = (slot, size)
        xh = self._handles.pop(key, None)
        if xh is None:
            agent, offset = self._ep.agent, slot * SLOT_BYTES
            local = agent.get_xfer_descs([(self._ep.send_buf.data_ptr() + offset, size, 0)], "DRAM")
            remote = agent.get_xfer_descs([(self._remote_addr + offset, size, 0)], "DRAM")
            xh = agent.initialize_xfer("WRITE", local, remote, self._remote, b"")
            if len(self._handles) >= MAX_HANDLES:
                self._drop_oldest_handle()
        self._handles[key] = xh
        return xh

    def _drop_oldest_handle(self) -> None:
        for key, xh in self._handles.items():
            if xh not in self._pending.values():
                del self._handles[key]
                self._ep.agent.release_xfer_handle(xh)
                return

    def _poll_pending(self) -> None:
        agent = self._ep.agent
        for slot, xh in list(self._pending.items()):
            state = agent.check_xfer_state(xh)
            if state == "PROC":
                continue
            if state != "DONE":
                self._failed = True  # close() parks the agent: UCX may abort on releasing it now
                raise PeerLostError(f"nixl WRITE to {self._stream.peer} ended in state {state}")
            del self._pending[slot]

    # Receiving

    def recv(self, out: Sequence[Any] | None = None, timeout: float | None = None) -> Message:
        deadline = time.monotonic() + (self.options.timeout_s if timeout is None else timeout)
        if self._closed:
            raise PeerLostError("channel is closed")
        with self._lock, nixl_errors(self._stream.peer):
            self._wait(lambda: self._rx_seq in self._inbox, deadline, "a message")
            slot, size = self._inbox.pop(self._rx_seq)
            self._rx_seq += 1
            try:
                return self._unpack(slot, size, out)
            finally:
                self._ep.agent.send_notif(self._remote, _CREDIT.pack(b"C", slot))

    def _unpack(self, slot: int, size: int, out: Sequence[Any] | None) -> Message:
        buf = self._recv_view[slot * SLOT_BYTES : slot * SLOT_BYTES + size]
        peer = self._stream.peer
        if size < FRAME_HDR.size:
            raise ProtocolError(f"nixl message from {peer} shorter than a frame header")
        ftype, meta_len, payload_len = parse_frame_header(buf[: FRAME_HDR.size], peer)
        if ftype != T_MSG or FRAME_HDR.size + meta_len + payload_len != size:
            raise ProtocolError(f"nixl message from {peer}: type {ftype}, sizes do not add up to {size}")
        start = FRAME_HDR.size + meta_len
        meta = bytes(buf[FRAME_HDR.size : start])
        check_frame_crc(buf[: FRAME_HDR.size], meta, peer)
        header, lengths = parse_msg_meta(meta, payload_len, self.options.max_msg_bytes, peer)
        if out is not None and (
            len(out) < len(lengths)
            or any(as_byte_view(o).nbytes < n for o, n in zip(out, lengths, strict=False))
        ):
            raise ValueError(f"recv(out=...) buffers too small or too few for payload lengths {lengths}")
        dsts = []
        for i, n in enumerate(lengths):
            dst = as_byte_view(out[i])[:n] if out is not None else memoryview(bytearray(n))
            dst[:] = buf[start : start + n]
            dsts.append(dst)
            start += n
        self.stats.record_received(payload_len)
        return Message(header, dsts)

    # Progress and liveness

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            self._pump()
            if ready():
                break
            self._check_alive(deadline, what)
            self._poller.pause()
        self._poller.active()

    def _pump(self) -> None:
        if self._pending:
            self._poll_pending()
        for agent_name, msgs in self._ep.agent.get_new_notifs().items():
            if agent_name != self._remote:
                logger.warning(
                    "nixl channel ignored %d notifications from unknown agent %r", len(msgs), agent_name
                )
                continue
            for raw in msgs:
                self._on_notif(raw)

    def _on_notif(self, raw: bytes) -> None:
        if len(raw) == _DATA.size and raw[:1] == b"D":
            _, seq, slot, size = _DATA.unpack(raw)
            if slot >= NUM_SLOTS or size > SLOT_BYTES or seq in self._inbox or seq < self._rx_seq:
                raise ProtocolError(f"bad nixl data notification from {self._stream.peer}")
            self._inbox[seq] = (slot, size)
        elif len(raw) == _CREDIT.size and raw[:1] == b"C":
            self._credits = min(NUM_SLOTS, self._credits + 1)
        else:
            raise ProtocolError(f"unknown nixl notification from {self._stream.peer}")

    def _check_alive(self, deadline: float, what: str) -> None:
        now = time.monotonic()
        if self._closed:
            raise PeerLostError("channel is closed")
        if now > deadline:
            raise TransportTimeout(f"nixl channel with {self._stream.peer}: no {what} within the timeout")
        if now > self._next_liveness:
            self._next_liveness = now + _LIVENESS_EVERY_S
            if self._stream.peer_closed():
                self._pump()  # a message sent just before the goodbye still counts
                if self._rx_seq in self._inbox:
                    return
                raise PeerLostError(f"nixl channel peer {self._stream.peer} is gone (control socket closed)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stream.close()  # EOF on the control socket is the goodbye
        if self._lock.acquire(timeout=1.0):  # a recv in another thread gives up within its timeout
            try:
                if self._failed or self._pending:  # the peer died with our WRITEs on its memory
                    park_agent(self._ep.agent, (self._ep, list(self._handles.values())))
                    self._ep.agent = None
                    return
                for xh in self._handles.values():
                    try:
                        self._ep.agent.release_xfer_handle(xh)
                    except Exception as err:  # a failed or still-running transfer
                        logger.debug("nixl release_xfer_handle failed: %s", err)
                self._handles.clear()
                self._pending.clear()
                release_agent(self._ep.agent, [self._ep.reg])
                self._ep.agent = None
            finally:
                self._lock.release()
