# SPDX-License-Identifier: Apache-2.0
"""The four one-sided operations the `mscclpp` backend needs, behind one small interface.

`Fabric` = endpoint + memory registration + connections; `Link.write` (bytes from a local
registered memory into a remote one), `Link.put_u64` (an 8-byte value written after everything
queued before it: the seqword / credit), `Link.flush` (bounded wait until the queue landed).

More: README.md, "fabric.py".
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from abc import ABC, abstractmethod
from typing import Any

from vllm_disagg import envs
from vllm_disagg.errors import PeerLostError, ProtocolError, TransportTimeout, TransportUnavailable
from vllm_disagg.transport.onesided.memory import memory_of

_HOST_HANDLE = struct.Struct("<IQQQ")  # pid, registry key, addr, nbytes


class LocalMemory:
    """A registered local range: `addr`/`nbytes`, the fabric's own object, its serialized form."""

    def __init__(self, addr: int, nbytes: int, native: Any, blob: bytes, keepalive: Any = None):
        self.addr, self.nbytes, self.native, self.blob, self.keepalive = addr, nbytes, native, blob, keepalive


class RemoteMemory:
    """A peer's registered range as imported from its blob (`nbytes` bounds every access)."""

    def __init__(self, nbytes: int, native: Any):
        self.nbytes, self.native = nbytes, native


def check_range(mem: LocalMemory | RemoteMemory, off: int, n: int, what: str) -> None:
    if off < 0 or n < 0 or off + n > mem.nbytes:
        raise ValueError(
            f"{what}: range [{off}, {off + n}) outside a registered memory of {mem.nbytes} bytes"
        )


class Link(ABC):
    """One connection to a peer; operations are queued in order and land in that order."""

    @abstractmethod
    def write(self, dst: RemoteMemory, dst_off: int, src: LocalMemory, src_off: int, n: int) -> None: ...

    @abstractmethod
    def put_u64(self, dst: RemoteMemory, dst_off: int, value: int) -> None: ...

    @abstractmethod
    def flush(self, timeout_s: float) -> None:
        """Wait until every queued operation landed; TransportTimeout / PeerLostError otherwise."""


class Ring(ABC):
    """Receiver-owned ring memory (bodies + u64 seqwords) that the local CPU reads."""

    mem: LocalMemory

    @abstractmethod
    def read_u64(self, off: int) -> int: ...

    @abstractmethod
    def read(self, off: int, n: int) -> bytes: ...

    @abstractmethod
    def write_local(self, off: int, data: bytes) -> None:
        """Fill part of this memory from the local CPU (staging of notification bodies)."""


class Fabric(ABC):
    @abstractmethod
    def new_endpoint(self) -> tuple[Any, bytes]:
        """A fresh local endpoint (one per connection: an IB endpoint owns a QP) and its blob."""

    @abstractmethod
    def connect(self, local: Any, remote_endpoint: bytes, peer: str) -> Link: ...

    @abstractmethod
    def register(self, obj: Any) -> LocalMemory:
        """Register a contiguous tensor/buffer in place (never copied)."""

    @abstractmethod
    def import_memory(self, blob: bytes, peer: str) -> RemoteMemory: ...

    @abstractmethod
    def ring(self, nbytes: int) -> Ring:
        """Zeroed, registered memory for a notification ring or credit word."""


# ---- host fabric (one process; tests) ---------------------------------------------------------
class _HostRegistry:
    lock = threading.Lock()
    live: dict[int, tuple[int, int]] = {}  # key -> (addr, nbytes)
    next_key = 1


class HostRing(Ring):
    def __init__(self, fabric: HostFabric, nbytes: int):
        self._buf = ctypes.create_string_buffer(nbytes)
        self.mem = fabric.register(memoryview(self._buf).cast("B"))

    def read_u64(self, off: int) -> int:
        return ctypes.c_uint64.from_address(self.mem.addr + off).value

    def read(self, off: int, n: int) -> bytes:
        return ctypes.string_at(self.mem.addr + off, n)

    def write_local(self, off: int, data: bytes) -> None:
        check_range(self.mem, off, len(data), "staging write")
        ctypes.memmove(self.mem.addr + off, data, len(data))


class HostLink(Link):
    def __init__(self, peer: str):
        self.peer, self.broken = peer, False

    def write(self, dst: RemoteMemory, dst_off: int, src: LocalMemory, src_off: int, n: int) -> None:
        self._check()
        check_range(dst, dst_off, n, "write destination")
        check_range(src, src_off, n, "write source")
        ctypes.memmove(dst.native + dst_off, src.addr + src_off, n)

    def put_u64(self, dst: RemoteMemory, dst_off: int, value: int) -> None:
        self._check()
        check_range(dst, dst_off, 8, "put_u64 destination")
        ctypes.c_uint64.from_address(dst.native + dst_off).value = value

    def flush(self, timeout_s: float) -> None:
        self._check()

    def _check(self) -> None:
        if self.broken:
            raise PeerLostError(f"link to {self.peer} is broken")


class HostFabric(Fabric):
    """memmove between registered ranges of this process (see module docstring)."""

    def new_endpoint(self) -> tuple[Any, bytes]:
        return None, struct.pack("<I", os.getpid())

    def connect(self, local: Any, remote_endpoint: bytes, peer: str) -> Link:
        if remote_endpoint != self.new_endpoint()[1]:
            raise ProtocolError(f"host fabric endpoint from {peer} is not this process")
        return HostLink(peer)

    def register(self, obj: Any) -> LocalMemory:
        mem = memory_of(obj)
        with _HostRegistry.lock:
            key = _HostRegistry.next_key
            _HostRegistry.next_key += 1
            _HostRegistry.live[key] = (mem.addr, mem.nbytes)
        blob = _HOST_HANDLE.pack(os.getpid(), key, mem.addr, mem.nbytes)
        return LocalMemory(mem.addr, mem.nbytes, key, blob, mem.keepalive)

    def import_memory(self, blob: bytes, peer: str) -> RemoteMemory:
        if len(blob) != _HOST_HANDLE.size:
            raise ProtocolError(f"host memory handle from {peer} has {len(blob)} bytes")
        pid, key, addr, nbytes = _HOST_HANDLE.unpack(blob)
        with _HostRegistry.lock:
            live = _HostRegistry.live.get(key)
        if pid != os.getpid() or live != (addr, nbytes):
            raise ProtocolError(f"host memory handle from {peer} names no live registration here")
        return RemoteMemory(nbytes, addr)

    def ring(self, nbytes: int) -> Ring:
        return HostRing(self, nbytes)


# ---- mscclpp fabric (GPU; never run here) -----------------------------------------------------
def _vec(blob: bytes) -> list[str]:  # pragma: no cover - GPU only
    """Python form of std::vector<char> under nanobind's stl caster (1-char strings)."""
    return list(blob.decode("latin-1"))


def _blob(vec: Any) -> bytes:  # pragma: no cover - GPU only
    if isinstance(vec, (bytes, bytearray)):
        return bytes(vec)
    return "".join(vec).encode("latin-1") if vec and isinstance(vec[0], str) else bytes(vec)


class MscclppRing(Ring):  # pragma: no cover - GPU only
    """Ring in device memory (CudaIpc needs it there; IB reaches it GPU-direct); read by small
    D2H copies. A device-side consumer would poll it with csrc/seqno_poll.cu instead."""

    def __init__(self, fabric: MscclppFabric, nbytes: int):
        import torch

        self.t = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{fabric.device_id}")
        self.mem = fabric.register(self.t)

    def read_u64(self, off: int) -> int:
        return int.from_bytes(self.t[off : off + 8].cpu().numpy().tobytes(), "little")

    def read(self, off: int, n: int) -> bytes:
        return self.t[off : off + n].cpu().numpy().tobytes()

    def write_local(self, off: int, data: bytes) -> None:
        import torch

        check_range(self.mem, off, len(data), "staging write")
        self.t[off : off + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.current_stream(self.t.device).synchronize()  # landed before mscclpp reads it


class MscclppLink(Link):  # pragma: no cover - GPU only
    def __init__(self, conn: Any, peer: str):
        self.conn, self.peer = conn, peer
        self._scratch = ctypes.c_uint64(0)  # update_and_sync's local copy of the value

    def write(self, dst: RemoteMemory, dst_off: int, src: LocalMemory, src_off: int, n: int) -> None:
        check_range(dst, dst_off, n, "write destination")
        check_range(src, src_off, n, "write source")
        self._call(self.conn.write, dst.native, dst_off, src.native, src_off, n)

    def put_u64(self, dst: RemoteMemory, dst_off: int, value: int) -> None:
        check_range(dst, dst_off, 8, "put_u64 destination")
        self._call(self.conn.update_and_sync, dst.native, dst_off, ctypes.addressof(self._scratch), value)

    def flush(self, timeout_s: float) -> None:
        try:
            self.conn.flush(int(timeout_s * 1e6))
        except Exception as err:  # mscclpp raises Error/CudaError/IbError; its message says which
            text = f"mscclpp flush to {self.peer}: {type(err).__name__}: {err}"
            raise (TransportTimeout if "imeout" in str(err) else PeerLostError)(text) from None

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as err:
            raise PeerLostError(f"mscclpp op to {self.peer}: {type(err).__name__}: {err}") from None


class MscclppFabric(Fabric):  # pragma: no cover - GPU only
    """mscclpp host API; `channel` "port" = IB transport (proxy/NIC), "memory" = CudaIpc."""

    def __init__(self, channel: str | None = None, device_id: int | None = None):
        import mscclpp
        import torch
        from mscclpp._mscclpp import CppContext, CppEndpoint

        self.m, self._endpoint_cls = mscclpp, CppEndpoint
        self.channel = channel or envs.mscclpp_channel()
        self.device_id = torch.cuda.current_device() if device_id is None else device_id
        self.transport = mscclpp.Transport.CudaIpc if self.channel == "memory" else mscclpp.Transport.IB0
        self.ctx = CppContext.create()
        self.config = mscclpp.EndpointConfig(
            self.transport, mscclpp.Device(mscclpp.DeviceType.GPU, self.device_id)
        )

    def new_endpoint(self) -> tuple[Any, bytes]:
        ep = self.ctx.create_endpoint(self.config)
        return ep, _blob(ep.serialize())

    def connect(self, local: Any, remote_endpoint: bytes, peer: str) -> Link:
        try:
            remote = self._endpoint_cls.deserialize(_vec(remote_endpoint))
            return MscclppLink(self.ctx.connect(local, remote), peer)
        except Exception as err:
            raise ProtocolError(f"mscclpp connect to {peer}: {type(err).__name__}: {err}") from None

    def register(self, obj: Any) -> LocalMemory:
        mem = memory_of(obj)
        if not mem.is_gpu and self.channel == "memory":
            raise ValueError("mscclpp memory channel (CudaIpc) needs CUDA tensors")
        native = self.ctx.register_memory(mem.addr, mem.nbytes, self.m.TransportFlags(self.transport))
        return LocalMemory(mem.addr, mem.nbytes, native, _blob(native.serialize()), mem.keepalive)

    def import_memory(self, blob: bytes, peer: str) -> RemoteMemory:
        try:
            native = self.m.RegisteredMemory.deserialize(_vec(blob))
        except Exception as err:
            raise ProtocolError(f"mscclpp memory handle from {peer}: {type(err).__name__}: {err}") from None
        return RemoteMemory(int(native.size()), native)

    def ring(self, nbytes: int) -> Ring:
        return MscclppRing(self, nbytes)


def default_fabric() -> Fabric:
    """The real fabric; TransportUnavailable when mscclpp or CUDA is missing."""
    try:
        return MscclppFabric()
    except ImportError as err:  # pragma: no cover - depends on the machine
        raise TransportUnavailable(f"mscclpp not importable: {err}") from None
