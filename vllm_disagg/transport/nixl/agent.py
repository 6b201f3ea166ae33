# SPDX-License-Identifier: Apache-2.0
"""Thin helpers over NIXL 1.5.1's Python agent: creation with the settings this project needs,
descriptor arrays, region tables with addresses, notification encoding, bounded polling.

Settings (see /work/shared/notes/transports-on-this-box.md §4): no progress thread (on small
boxes it spins 4 threads and turns 50 µs into 24 ms), so the initiator must poll
`check_xfer_state` and the target must poll `get_new_notifs` to make progress; every poll loop
here is bounded by a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import time
from typing import Any

import numpy as np

from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError
from vllm_disagg.transport.base import RegionInfo
from vllm_disagg.transport.kv_common import pack_region_table, parse_region_table
from vllm_disagg.transport.wire import MAX_TID_BYTES

KV_SERVICE = b"nixl-kv"  # control-channel service tag of the KV push
_ADDR = struct.Struct("<QI")  # base address, device id
_NOTIF = struct.Struct("<QiQH")  # seq, layer, nbytes, tid_len; then tid
_LEN = struct.Struct("<I")
_BYE = struct.Struct("<Q")  # BYE meta: how many write_blocks the sender issued to this receiver


def import_reason() -> str | None:
    """None if nixl (with its UCX plugin) imports here, else what is missing."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as err:  # ImportError, or a broken native library
        return f"nixl is not importable ({type(err).__name__}: {err}); pip install nixl==1.5.1"
    return None


def make_agent(role: str, host: str = "127.0.0.1") -> tuple[Any, str]:
    """A fresh agent with a unique name, UCX backend, no progress thread."""
    _ucx_env_defaults(host)
    from nixl._api import nixl_agent, nixl_agent_config

    _quiet_nixl_logging()

    name = f"vd-{role}-{os.getpid()}-{os.urandom(4).hex()}"
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
    return nixl_agent(name, config), name


# Agents whose peer died with transfers on their memory: UCX can abort the process (SIGABRT, seen
# here in about one run in four) when that memory is deregistered or the agent is destroyed. Such an
# agent, and the tensors it registered, get one extra reference that is never dropped: neither is
# ever freed by Python (not even at interpreter exit); the OS reclaims them with the process.


def park_agent(agent: Any, keep_alive: Any) -> None:
    """Never free `agent` or `keep_alive` (the tensors it registered) in this process."""
    for obj in (keep_alive, agent):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def release_agent(agent: Any, reg_descs: list) -> None:
    """Deregister memory while the tensors behind it are still alive; the caller then drops its
    last reference to the agent. Left to the garbage collector, a reference cycle could free the
    tensors first, and UCX aborts the process when it later unregisters freed memory."""
    for descs in reg_descs:
        try:
            agent.deregister_memory(descs)
        except Exception as err:  # already gone; nothing else to undo
            logging.getLogger(__name__).debug("nixl deregister_memory failed: %s", err)


def _ucx_env_defaults(host: str) -> None:
    """UCX settings for machines without an RDMA device (explicit env vars always win).

    * UCX_MODULES=^ib: the wheel's bundled libnl-route crashes in its ELF destructor
      (rtnl_tc_unregister) at process exit once UCX loaded its ib module, so every process that
      made an agent died with SIGSEGV (exit code 139) after finishing its work. Without a device
      the ib module has nothing to drive; where /sys/class/infiniband lists devices we keep it.
    * UCX_NET_DEVICES=lo when our host is loopback: keep UCX's tcp lanes on 127.0.0.1.
    """
    if not _has_rdma_device():
        os.environ.setdefault("UCX_MODULES", "^ib")
    if host.startswith("127.") or host == "localhost":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _quiet_nixl_logging() -> None:
    """nixl logs every agent creation at INFO to stdout; keep warnings and errors only."""
    for name in list(logging.root.manager.loggerDict):
        if name == "nixl" or name.startswith("nixl."):
            logging.getLogger(name).setLevel(logging.WARNING)


def _has_rdma_device() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def mem_type(tensor: Any) -> str:
    return "VRAM" if tensor.device.type == "cuda" else "DRAM"


def tensor_region(name: str, tensor: Any) -> tuple[RegionInfo, int, int]:
    """(info, base address, device id) of a contiguous `[num_blocks, ...]` tensor (CPU or GPU)."""
    if not tensor.is_contiguous() or tensor.dim() < 1 or tensor.shape[0] < 1:
        raise ValueError(
            f"region {name!r} must be a contiguous [num_blocks, ...] tensor, got {tuple(tensor.shape)}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    num_blocks = int(tensor.shape[0])
    dev = tensor.get_device() if tensor.device.type == "cuda" else 0
    return RegionInfo(name, num_blocks, nbytes // num_blocks), tensor.data_ptr(), dev


def pack_regions(infos: list[RegionInfo], addrs: list[tuple[int, int]], metadata: bytes) -> bytes:
    table = pack_region_table(infos)
    return table + b"".join(_ADDR.pack(*a) for a in addrs) + _LEN.pack(len(metadata)) + metadata


def parse_regions(raw: bytes, peer: str) -> tuple[list[RegionInfo], list[tuple[int, int]], bytes]:
    infos, pos = parse_region_table(raw, peer)
    try:
        addrs = [_ADDR.unpack_from(raw, pos + i * _ADDR.size) for i in range(len(infos))]
        pos += len(infos) * _ADDR.size
        (meta_len,) = _LEN.unpack_from(raw, pos)
        metadata = raw[pos + _LEN.size : pos + _LEN.size + meta_len]
    except struct.error as err:
        raise ProtocolError(f"malformed nixl region table from {peer}: {err}") from None
    if len(metadata) != meta_len:
        raise ProtocolError(f"truncated nixl agent metadata from {peer}")
    return infos, addrs, metadata


def pack_notif(seq: int, layer: int, nbytes: int, transfer_id_bytes: bytes) -> bytes:
    return _NOTIF.pack(seq, layer, nbytes, len(transfer_id_bytes)) + transfer_id_bytes


def parse_notif(raw: bytes, peer: str) -> tuple[int, int, int, str]:
    if len(raw) < _NOTIF.size:
        raise ProtocolError(f"short nixl notification from {peer}")
    seq, layer, nbytes, transfer_id_len = _NOTIF.unpack_from(raw)
    if transfer_id_len > MAX_TID_BYTES or len(raw) != _NOTIF.size + transfer_id_len:
        raise ProtocolError(f"malformed nixl notification from {peer}")
    try:
        return seq, layer, nbytes, raw[_NOTIF.size :].decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"nixl notification from {peer}: transfer_id is not UTF-8") from None


def pack_bye(num_writes: int) -> bytes:
    return _BYE.pack(num_writes)


def parse_bye(meta: bytes, peer: str) -> int | None:
    """The number of writes a clean goodbye announces; None from a sender that does not say."""
    if not meta:
        return None
    if len(meta) != _BYE.size:
        raise ProtocolError(f"malformed nixl BYE from {peer}: {len(meta)} bytes")
    return _BYE.unpack(meta)[0]


def block_descs(
    base: int, block_nbytes: int, first_ids: list[int], lengths: list[int], dev: int
) -> np.ndarray:
    """Nx3 (addr, len, dev) descriptors, one per run of consecutive blocks."""
    out = np.empty((len(first_ids), 3), dtype=np.uint64)
    out[:, 0] = base + np.asarray(first_ids, dtype=np.uint64) * np.uint64(block_nbytes)
    out[:, 1] = np.asarray(lengths, dtype=np.uint64) * np.uint64(block_nbytes)
    out[:, 2] = dev
    return out


class Poller:
    """Poll pacing for NIXL without a progress thread (nothing to block on): spin for `spin_s`
    after the last activity, then poll with a `sched_yield` between polls (a pure spin on a 2-core
    box takes the core the peer needs) for `yield_s`, then sleep in naps growing to `max_nap_s`.
    A waiting caller (the message channel) yields long; a background thread (the KV sender and
    receiver, sharing the GIL with the engine) naps soon."""

    def __init__(self, spin_s: float, yield_s: float = 0.02, max_nap_s: float = 0.001):
        self.spin_s, self.yield_s, self.max_nap_s = spin_s, yield_s, max_nap_s
        self.last_active = time.perf_counter()

    def active(self) -> None:
        self.last_active = time.perf_counter()

    def pause(self) -> None:
        idle = time.perf_counter() - self.last_active
        if idle < self.spin_s:
            return
        if idle < self.yield_s:
            os.sched_yield()
        else:
            time.sleep(min(self.max_nap_s, idle / 20))


@contextlib.contextmanager
def nixl_errors(peer: str):
    """Turn nixl's own exceptions (e.g. nixlRemoteDisconnectError) into PeerLostError."""
    try:
        yield
    except DisaggError:
        raise
    except Exception as err:
        if not type(err).__module__.startswith("nixl"):
            raise
        raise PeerLostError(f"nixl error with {peer}: {type(err).__name__}: {err}") from None
