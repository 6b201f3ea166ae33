# SPDX-License-Identifier: Apache-2.0
"""`mscclpp` backend: GPU-only (microsoft/mscclpp connections), behind the transport API.

Status: the KV data path is written against mscclpp's real host API (`fabric.MscclppFabric`,
`kv.py`; pinned commit and build recipe in README.md) but has **never run**: mscclpp is not on
PyPI, needs CUDA (+ NVML, libcuda) to build and an NVIDIA driver to import, and no GPU was lent.
Everything around mscclpp (control payloads, ring/seqno protocol, block-run planning, errors)
runs in CI through the same `Fabric` interface with `HostFabric` (in-process memmove,
`tests/unit/transport/test_mscclpp_backend.py`). Importing this module is always safe; selecting
the backend where it cannot run raises `TransportUnavailable` with ONE line naming what is
missing, and it never falls back to another backend. The message channel is not implemented
(it says so); use rdma, nixl or tcp for messages.
"""

from __future__ import annotations

import glob
import importlib.util

from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport.base import Transport, TransportKind, TransportOptions

__all__ = ["MscclppTransport", "probe_mscclpp"]

_MSG_NOT_IMPLEMENTED = "the mscclpp message channel is not implemented; use rdma, nixl or tcp for messages"


def _cuda_device_present() -> bool:
    """A CUDA device node exists (cheap; does not import torch or load the driver)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def probe_mscclpp() -> str | None:
    """None when mscclpp could run here, else one line saying everything that is missing."""
    missing = []
    if not _cuda_device_present():
        missing.append("no CUDA GPU (/dev/nvidia* absent)")
    if importlib.util.find_spec("mscclpp") is None:
        missing.append("mscclpp not installed (not on PyPI: build github.com/microsoft/mscclpp with CUDA)")
    if missing:
        return "mscclpp is GPU-only: " + "; ".join(missing)
    return None


class MscclppTransport(Transport):
    kind = TransportKind.MSCCLPP
    DOCTOR_NOTE = "KV push only; data path not yet verified on hardware (transport/mscclpp/README.md), try --probe"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return probe_mscclpp()

    def __init__(self, options: TransportOptions):
        reason = self.unavailable_reason()
        if reason is not None:
            raise TransportUnavailable(f"transport 'mscclpp' cannot run here: {reason}")
        super().__init__(options)  # pragma: no cover - GPU machines only

    def kv_receiver(self, name: str = "receiver"):  # pragma: no cover - GPU machines only
        from vllm_disagg.transport.mscclpp.fabric import default_fabric
        from vllm_disagg.transport.mscclpp.kv import MscclppKVReceiver

        return MscclppKVReceiver(self.options, name, default_fabric)

    def kv_sender(self, name: str = "sender"):  # pragma: no cover - GPU machines only
        from vllm_disagg.transport.mscclpp.fabric import default_fabric
        from vllm_disagg.transport.mscclpp.kv import MscclppKVSender

        return MscclppKVSender(self.options, name, default_fabric)

    def listen_msg(self):  # pragma: no cover - GPU machines only
        raise TransportUnavailable(_MSG_NOT_IMPLEMENTED)

    def connect_msg(self, address: str, timeout: float | None = None):  # pragma: no cover
        raise TransportUnavailable(_MSG_NOT_IMPLEMENTED)
