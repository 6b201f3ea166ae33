# SPDX-License-Identifier: Apache-2.0
"""`loopback` backend: both ends in one process, completing the same state machine instantly.

For warm-up and state-machine tests of the clients (scheduler/connector logic) without sockets.
It still checks the token, region bounds and ids exactly like the real backends, but it never
stands in for tcp or shm in integration tests: nothing crosses a process boundary here.
"""

from __future__ import annotations

import hmac
import itertools
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_disagg.errors import AuthError, PeerLostError, TransportTimeout
from vllm_disagg.transport.base import (
    BlockWrite,
    KVPeer,
    KVReceiver,
    KVSender,
    Message,
    MsgChannel,
    MsgListener,
    Notification,
    RegionInfo,
    Transport,
    TransportKind,
    TransportOptions,
    TransportStats,
    XferHandle,
)
from vllm_disagg.transport.kv_common import Region, joint_runs, plan_writes, region_from_tensor
from vllm_disagg.transport.wire import as_byte_view

__all__ = ["LoopbackTransport"]

_registry: dict[str, Any] = {}
_registry_lock = threading.Lock()
_ids = itertools.count()


def _publish(obj: Any) -> str:
    address = f"loopback:{next(_ids)}"
    with _registry_lock:
        _registry[address] = obj
    return address


def _lookup(address: str, token: str) -> Any:
    with _registry_lock:
        obj = _registry.get(address)
    if obj is None:
        raise PeerLostError(f"no loopback endpoint at {address!r} in this process")
    if not hmac.compare_digest(obj.options.auth_token.encode(), token.encode()):
        raise AuthError(f"loopback endpoint {address} rejected the token")
    return obj


def _unpublish(address: str | None) -> None:
    with _registry_lock:
        _registry.pop(address, None)


class LoopbackKVReceiver(KVReceiver):
    def __init__(self, options: TransportOptions, name: str):
        self.options, self.name = options, name
        self.stats = TransportStats()
        self.regions: list[Region] = []
        self.notifs: queue.Queue[Notification] = queue.Queue()
        self._address: str | None = None

    def register_region(self, name: str, tensor: Any) -> RegionInfo:
        if self._address is not None or any(r.info.name == name for r in self.regions):
            raise ValueError(f"region {name!r}: register each name once, before start()")
        self.regions.append(region_from_tensor(name, tensor))
        return self.regions[-1].info

    def start(self) -> str:
        self._address = self._address or _publish(self)
        return self._address

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("KV receiver not started")
        return self._address

    def poll_notifications(self) -> list[Notification]:
        out = []
        while not self.notifs.empty():
            out.append(self.notifs.get_nowait())
        return out

    def wait_notification(self, timeout: float | None = None) -> Notification:
        try:
            return self.notifs.get(timeout=self.options.timeout_s if timeout is None else timeout)
        except queue.Empty:
            raise TransportTimeout(f"no KV notification on {self._address}") from None

    def close(self) -> None:
        _unpublish(self._address)


class LoopbackKVPeer(KVPeer):
    def __init__(self, sender_name: str, rx: LoopbackKVReceiver, stats: TransportStats):
        self._name, self._rx, self._stats = sender_name, rx, stats
        self.regions = {r.info.name: r.info for r in rx.regions}
        self._index = {r.info.name: (i, r.info) for i, r in enumerate(rx.regions)}
        self._seq = 0
        self._lock = threading.Lock()

    def write_blocks(self, writes: Sequence[BlockWrite], transfer_id: str, layer: int = -1) -> XferHandle:
        plans = plan_writes(list(writes), self._index)
        nbytes = sum(len(p.src_ids) * p.src.shape[1] for p in plans)
        handle = XferHandle(nbytes, self._stats)
        if _registry.get(self._rx._address) is not self._rx:
            handle._finish(PeerLostError(f"loopback receiver {self._rx._address} is closed"))
            return handle
        for p in plans:
            dst = self._rx.regions[p.region_idx].blocks
            for s, d, n in joint_runs(p.src_ids, p.dst_ids):
                np.copyto(dst[d : d + n], p.src[s : s + n])
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._rx.stats.record_received(nbytes, notifications=1)
            self._rx.notifs.put(Notification(self._name, transfer_id, layer, seq, nbytes))
        handle._finish()
        return handle

    def close(self) -> None:
        pass


class LoopbackKVSender(KVSender):
    def __init__(self, options: TransportOptions, name: str):
        self.options, self.name = options, name
        self.stats = TransportStats()

    def connect(self, address: str, timeout: float | None = None) -> KVPeer:
        return LoopbackKVPeer(self.name, _lookup(address, self.options.auth_token), self.stats)

    def close(self) -> None:
        pass


class LoopbackChannel(MsgChannel):
    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, options: TransportOptions):
        self._in, self._out, self.options = inbox, outbox, options
        self.stats = TransportStats()

    def send(self, header: bytes, tensors: Sequence[Any] = (), timeout: float | None = None) -> None:
        payloads = [bytes(as_byte_view(t)) for t in tensors]
        self._out.put((bytes(header), payloads))
        self.stats.record_op(sum(map(len, payloads)), 0.0)

    def recv(self, out: Sequence[Any] | None = None, timeout: float | None = None) -> Message:
        try:
            item = self._in.get(timeout=self.options.timeout_s if timeout is None else timeout)
        except queue.Empty:
            raise TransportTimeout("no loopback message within the timeout") from None
        if item is None:
            raise PeerLostError("loopback peer closed the channel")
        header, payloads = item
        if out is None:
            return Message(header, [memoryview(bytearray(p)) for p in payloads])
        views = [as_byte_view(o) for o in out[: len(payloads)]]
        if len(views) < len(payloads) or any(v.nbytes < len(p) for v, p in zip(views, payloads, strict=True)):
            raise ValueError(
                f"recv(out=...) buffers too small or too few for payload lengths {list(map(len, payloads))}"
            )
        for v, p in zip(views, payloads, strict=True):
            v[: len(p)] = p
        return Message(header, [v[: len(p)] for v, p in zip(views, payloads, strict=True)])

    def close(self) -> None:
        self._out.put(None)


class LoopbackListener(MsgListener):
    def __init__(self, options: TransportOptions):
        self.options = options
        self.pending: queue.Queue[MsgChannel] = queue.Queue()
        self._address = _publish(self)

    @property
    def address(self) -> str:
        return self._address

    def accept(self, timeout: float | None = None) -> MsgChannel:
        try:
            return self.pending.get(timeout=self.options.timeout_s if timeout is None else timeout)
        except queue.Empty:
            raise TransportTimeout(f"no loopback client on {self._address}") from None

    def close(self) -> None:
        _unpublish(self._address)


class LoopbackTransport(Transport):
    kind = TransportKind.LOOPBACK
    DOCTOR_NOTE = "in-process only (tests, warm-up)"
    receiver_cls = LoopbackKVReceiver
    sender_cls = LoopbackKVSender
    listener_cls = LoopbackListener

    def connect_msg(self, address: str, timeout: float | None = None) -> MsgChannel:
        listener = _lookup(address, self.options.auth_token)
        a, b = queue.Queue(), queue.Queue()
        listener.pending.put(LoopbackChannel(b, a, self.options))
        return LoopbackChannel(a, b, self.options)
