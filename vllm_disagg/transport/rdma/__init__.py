# SPDX-License-Identifier: Apache-2.0
"""`rdma` backend placeholder: the pyverbs path is a later issue (see `README.md` here).

Selecting it fails at start-up with one line naming what is missing; it never falls back to
another backend. `unavailable_reason()` probes the machine the way the pyverbs backend will.
"""

from __future__ import annotations

import os

from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport.base import Transport, TransportKind

__all__ = ["RdmaTransport", "probe_ibverbs"]

_SYSFS_IB = "/sys/class/infiniband"


def probe_ibverbs() -> str | None:
    """None when an ibverbs device is visible through pyverbs, else what is missing."""
    try:
        devices = os.listdir(_SYSFS_IB)
    except OSError:
        devices = []
    if not devices:
        return f"no RDMA device ({_SYSFS_IB} missing or empty; kernel without CONFIG_INFINIBAND or no NIC/rxe)"
    try:
        import pyverbs.device as pd  # Debian's python3-pyverbs, matching the system rdma-core
    except ImportError as err:
        return f"pyverbs not importable ({err}); install Debian's python3-pyverbs"
    try:
        if not pd.get_device_list():
            return "pyverbs sees no ibverbs device"
    except Exception as err:  # PyverbsRDMAError; its errno is often lost
        return f"pyverbs cannot list devices: {err}"
    return None


class RdmaTransport(Transport):
    kind = TransportKind.RDMA

    @classmethod
    def unavailable_reason(cls) -> str | None:
        missing = probe_ibverbs()
        if missing is not None:
            return missing
        return "the pyverbs backend is not implemented yet (later issue); use nixl, which drives verbs via UCX"

    def __init__(self, options):
        raise TransportUnavailable(f"transport 'rdma' cannot run here: {self.unavailable_reason()}")

    def kv_receiver(self, name: str = "receiver"):
        raise NotImplementedError

    def kv_sender(self, name: str = "sender"):
        raise NotImplementedError

    def listen_msg(self):
        raise NotImplementedError

    def connect_msg(self, address: str, timeout: float | None = None):
        raise NotImplementedError
