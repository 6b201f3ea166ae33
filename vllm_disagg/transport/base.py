# SPDX-License-Identifier: Apache-2.0
"""The transport contract: every backend (tcp, shm, nixl, loopback; rdma later) implements it.

Two clients, two shapes (README.md, "base.py").

More: README.md, "base.py".
"""

from __future__ import annotations

import enum
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_disagg.errors import DisaggError, TransportTimeout

__all__ = [
    "TransportKind",
    "XferState",
    "TransportOptions",
    "RegionInfo",
    "BlockWrite",
    "Notification",
    "Message",
    "TransportStats",
    "XferHandle",
    "KVReceiver",
    "KVPeer",
    "KVSender",
    "MsgChannel",
    "MsgListener",
    "Transport",
]


class TransportKind(str, enum.Enum):
    TCP = "tcp"
    SHM = "shm"
    NIXL = "nixl"
    RDMA = "rdma"
    MSCCLPP = "mscclpp"
    LOOPBACK = "loopback"


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


def _default_spin_us() -> float:
    return 0.0 if (os.cpu_count() or 1) <= 2 else 50.0


@dataclass(frozen=True)
class TransportOptions:
    """Settings shared by all backends; backends ignore what does not apply to them."""

    auth_token: str = field(repr=False)
    """Shared secret every peer must prove (HMAC challenge); required, never logged."""
    host: str = "127.0.0.1"
    """Interface listeners bind to (tcp, nixl control channel)."""
    port: int = 0
    """Listening port; 0 picks a free one (read `address` after `start()`)."""
    num_streams: int = 2
    """Parallel TCP connections per KV peer (tcp backend)."""
    timeout_s: float = 30.0
    """Default bound on every wait (connect, send, recv, notification, transfer)."""
    spin_us: float = field(default_factory=lambda: _default_spin_us())
    """shm/nixl: busy-poll this long before sleeping (lower latency, burns a core). Default 50 µs,
    0 on machines with <= 2 CPUs, where a spinning peer only delays the process it waits for."""
    max_msg_bytes: int = 1 << 30
    """Largest accepted message payload; bigger frames are rejected as malformed."""
    chunk_bytes: int = 4 << 20
    """KV writes are cut into frames of about this size, spread over the streams."""

    def __post_init__(self) -> None:
        if not self.auth_token:
            raise ValueError("TransportOptions.auth_token must be a non-empty shared secret")
        if self.num_streams < 1 or self.timeout_s <= 0:
            raise ValueError("TransportOptions: num_streams must be >= 1 and timeout_s > 0")


@dataclass(frozen=True)
class RegionInfo:
    """A registered receive region: `num_blocks` blocks of `block_nbytes` bytes each."""

    name: str
    num_blocks: int
    block_nbytes: int


@dataclass(frozen=True)
class BlockWrite:
    """Copy `src[src_block_ids[i]]` to block `dst_block_ids[i]` of the peer's region `region`.

    `src` is a contiguous tensor `[num_blocks, ...]` whose block size equals the region's.
    """

    region: str
    src: Any  # torch.Tensor (kept untyped so this module imports without torch)
    src_block_ids: Sequence[int]
    dst_block_ids: Sequence[int]


@dataclass(frozen=True)
class Notification:
    """Delivered at the receiver after all bytes of one `write_blocks` call have landed."""

    peer: str
    """The sender's name (as given to `Transport.kv_sender(name)`), authenticated."""
    transfer_id: str
    layer: int
    """Layer index given by the sender; -1 means "not layer-scoped" (e.g. one serialized send)."""
    seq: int
    """Per-peer sequence number, 0, 1, 2, ... in issue order; delivery follows it strictly."""
    nbytes: int


@dataclass
class Message:
    """One received message. `buffers[i]` is a byte view of payload i: a prefix of `out[i]` when
    `recv(out=...)` was used, else a fresh `bytearray`'s view."""

    header: bytes
    buffers: list[memoryview]

    @property
    def lengths(self) -> list[int]:
        return [b.nbytes for b in self.buffers]


@dataclass
class TransportStats:
    """Counters of one transport object (users may export them to Prometheus)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    num_ops: int = 0
    num_failed_ops: int = 0
    num_notifications: int = 0
    num_rejected_frames: int = 0
    op_seconds_total: float = 0.0
    op_seconds_max: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_op(self, nbytes_sent: int, seconds: float, ok: bool = True) -> None:
        with self._lock:
            self.bytes_sent += nbytes_sent
            self.num_ops += 1
            self.num_failed_ops += 0 if ok else 1
            self.op_seconds_total += seconds
            self.op_seconds_max = max(self.op_seconds_max, seconds)

    def record_received(self, nbytes: int, notifications: int = 0) -> None:
        with self._lock:
            self.bytes_received += nbytes
            self.num_notifications += notifications

    def record_rejected(self) -> None:
        with self._lock:
            self.num_rejected_frames += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class XferHandle:
    """Completion of one asynchronous operation; backends call `_finish()` exactly once."""

    def __init__(self, nbytes: int, stats: TransportStats | None = None):
        self.nbytes = nbytes
        self.error: DisaggError | None = None
        self._event = threading.Event()
        self._stats = stats
        self._t0 = time.perf_counter()
        self._state = XferState.PENDING

    def state(self) -> XferState:
        return self._state

    def wait(self, timeout: float | None = None) -> None:
        """Block until DONE (returns) or FAILED (raises `error`); `TransportTimeout` past `timeout`."""
        if not self._event.wait(timeout):
            raise TransportTimeout(f"transfer of {self.nbytes} bytes still pending after {timeout}s")
        if self.error is not None:
            raise self.error

    def _finish(self, error: DisaggError | None = None) -> None:
        if self._event.is_set():
            return
        self.error = error
        self._state = XferState.FAILED if error else XferState.DONE
        if self._stats is not None:
            self._stats.record_op(self.nbytes, time.perf_counter() - self._t0, ok=error is None)
        self._event.set()


class KVReceiver(ABC):
    """Decode side of the KV push: owns registered regions and receives notifications."""

    stats: TransportStats

    @abstractmethod
    def register_region(self, name: str, tensor: Any) -> RegionInfo:
        """Expose a contiguous `[num_blocks, ...]` tensor as a write target; call before `start()`.
        (shm moves the tensor's storage into shared memory in place; views stay valid.)"""

    @abstractmethod
    def start(self) -> str:
        """Start serving and return the address to hand to `KVSender.connect`."""

    @property
    @abstractmethod
    def address(self) -> str:
        """`host:port` (tcp, nixl) or a unix socket name (shm); valid after `start()`."""

    @abstractmethod
    def poll_notifications(self) -> list[Notification]:
        """Return (and consume) the notifications ready now; never blocks."""

    @abstractmethod
    def wait_notification(self, timeout: float | None = None) -> Notification:
        """Block for the next notification; `TransportTimeout` when none comes in time."""

    def lost_peers(self) -> list[str]:
        """Names of senders whose connection broke since the last call (drained). Optional."""
        return []

    exact_fence: bool = False
    """`fence` really stops a transfer's later bytes here (the receiver lands them itself), so the decode
    side may hand a failed push's blocks back without waiting for the sender's CANCEL_ACK."""

    def fence(self, transfer_id: str) -> bool:
        """Drop every write of `transfer_id` that lands from now on (the decode side gave up on it and
        its blocks go back to vLLM); True once none of its writes is mid-landing, else call again.
        Here: True. Where the sender places the bytes itself (shm's copy, RDMA, NIXL) the receiver
        cannot stop them, and the sender's CANCEL_ACK (no write in flight) is the fence."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release resources; idempotent."""


class KVPeer(ABC):
    """The sender's connection to one `KVReceiver`."""

    regions: dict[str, RegionInfo]
    """The receiver's regions, learned at connect time."""

    @abstractmethod
    def write_blocks(self, writes: Sequence[BlockWrite], transfer_id: str, layer: int = -1) -> XferHandle:
        """Queue the copies and return at once. One notification (transfer_id, layer) follows them.
        Raises ValueError on caller mistakes; wire/peer failures fail the handle instead."""

    @abstractmethod
    def close(self) -> None:
        """Wait for queued writes (bounded), then disconnect; idempotent."""

    def usable(self) -> bool:
        """False once the connection is known to be broken (the receiver restarted, a write failed):
        a new connection is needed. Backends that cannot tell say True; a write then fails its handle."""
        return True


class KVSender(ABC):
    """Prefill side of the KV push."""

    stats: TransportStats

    @abstractmethod
    def connect(self, address: str, timeout: float | None = None) -> KVPeer:
        """Authenticate with the receiver at `address` and learn its regions."""

    @abstractmethod
    def close(self) -> None:
        """Close every peer; idempotent."""


class MsgChannel(ABC):
    """A bidirectional, ordered, framed message pipe between two processes."""

    stats: TransportStats

    @abstractmethod
    def send(self, header: bytes, tensors: Sequence[Any] = (), timeout: float | None = None) -> None:
        """Send `header` plus the raw bytes of each tensor/buffer (contiguous), zero-copy where the
        backend allows. Returns when the data is handed off (source may be reused)."""

    @abstractmethod
    def recv(self, out: Sequence[Any] | None = None, timeout: float | None = None) -> Message:
        """Receive the next message. With `out`, payload i lands in `out[i]` (a tensor or writable
        buffer with at least that many bytes) and `Message.buffers[i]` views it. If `out` is too
        small the message is consumed and dropped and ValueError is raised (the channel stays usable).
        `PeerLostError` when the peer closed or died, `TransportTimeout` past `timeout`."""

    @abstractmethod
    def close(self) -> None: ...


class MsgListener(ABC):
    @property
    @abstractmethod
    def address(self) -> str: ...

    @abstractmethod
    def accept(self, timeout: float | None = None) -> MsgChannel:
        """Next authenticated channel; bad or unauthenticated clients are logged and skipped."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    """Factory of one backend's roles. Get one with `vllm_disagg.transport.get_transport`."""

    kind: TransportKind

    def __init__(self, options: TransportOptions):
        self.options = options

    receiver_cls: type[KVReceiver]
    sender_cls: type[KVSender]
    listener_cls: type[MsgListener]
    """A backend names its role classes (built from the options), or overrides the factory."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can run here, else one line saying what is missing."""
        return None

    def kv_receiver(self, name: str = "receiver") -> KVReceiver:
        return self.receiver_cls(self.options, name)

    def kv_sender(self, name: str = "sender") -> KVSender:
        return self.sender_cls(self.options, name)

    def listen_msg(self) -> MsgListener:
        return self.listener_cls(self.options)

    @abstractmethod
    def connect_msg(self, address: str, timeout: float | None = None) -> MsgChannel: ...

    # ------------------------------------------------------------------ `vllm-disagg doctor`
    DOCTOR_NOTE = ""
    """What to know when it can run (same host only, not verified on hardware, ...)."""

    @classmethod
    def doctor(cls, probe: bool = False) -> str:
        """This backend's line in `vllm-disagg doctor`: "yes (...)" or "no - <what is missing>".

        `probe` also moves a few KV blocks through it inside this process."""
        reason = cls.unavailable_reason()
        if reason is not None:
            return f"no - {reason}"
        detail = cls.doctor_note()
        if probe:
            detail += f"; probe: {cls.doctor_probe()}"
        return f"yes ({detail})"

    @classmethod
    def doctor_note(cls) -> str:
        return cls.DOCTOR_NOTE

    @classmethod
    def doctor_probe(cls) -> str:
        """Write 4 blocks to ourselves and check them; 'ok (N ms)' or the error."""
        import torch

        t0 = time.perf_counter()
        tr = cls(TransportOptions(auth_token=os.urandom(8).hex(), timeout_s=10))
        rx, tx = tr.kv_receiver("doctor-rx"), None
        try:
            cache = torch.zeros(8, 1024)
            rx.register_region("probe", cache)
            tx = tr.kv_sender("doctor-tx")
            peer = tx.connect(rx.start(), timeout=10)
            src = torch.randn(8, 1024)
            peer.write_blocks([BlockWrite("probe", src, [0, 1, 2, 3], [4, 5, 6, 7])], "probe", 0).wait(10)
            rx.wait_notification(timeout=10)
            ok = torch.equal(cache[4:], src[:4])
            return f"ok ({(time.perf_counter() - t0) * 1e3:.0f} ms)" if ok else "FAILED: data mismatch"
        except Exception as err:  # report, don't crash the doctor
            return f"FAILED: {type(err).__name__}: {err}"
        finally:
            if tx is not None:
                tx.close()
            rx.close()
