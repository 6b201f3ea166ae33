# SPDX-License-Identifier: Apache-2.0
"""`mscclpp` backend: GPU-only (microsoft/mscclpp port/memory channels), behind the transport API.

Status: capability gate only. mscclpp is not on PyPI, needs CUDA (+ NVML, libcuda) to build and an
NVIDIA driver to import, and has no CPU data path, so nothing of it can run or even build on the
CPU build box (see `/work/shared/notes/transports-on-this-box.md` section 3). Importing this module
is always safe; selecting the backend where it cannot run raises `TransportUnavailable` with ONE
line naming what is missing, and it never falls back to another backend. The data path is
deliberately not written blind: it is specified in `README.md` here and gets implemented and tested
(`@pytest.mark.gpu`) when a GPU machine is lent.
"""

from __future__ import annotations

import glob
import importlib.util

from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport.base import Transport, TransportKind, TransportOptions

__all__ = ["MscclppTransport", "probe_mscclpp"]

_NOT_IMPLEMENTED = "the mscclpp data path is not implemented yet (GPU machine needed to build mscclpp against); use nixl or rdma"


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

    @classmethod
    def unavailable_reason(cls) -> str | None:
        reason = probe_mscclpp()
        return reason if reason is not None else _NOT_IMPLEMENTED

    def __init__(self, options: TransportOptions):
        reason = self.unavailable_reason()
        if reason is not None:
            raise TransportUnavailable(f"transport 'mscclpp' cannot run here: {reason}")
        super().__init__(options)  # pragma: no cover - unreachable until the data path exists

    def kv_receiver(self, name: str = "receiver"):  # pragma: no cover - gated in __init__
        raise TransportUnavailable(_NOT_IMPLEMENTED)

    def kv_sender(self, name: str = "sender"):  # pragma: no cover
        raise TransportUnavailable(_NOT_IMPLEMENTED)

    def listen_msg(self):  # pragma: no cover
        raise TransportUnavailable(_NOT_IMPLEMENTED)

    def connect_msg(self, address: str, timeout: float | None = None):  # pragma: no cover
        raise TransportUnavailable(_NOT_IMPLEMENTED)
