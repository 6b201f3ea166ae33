# SPDX-License-Identifier: Apache-2.0
"""`rdma` backend: pyverbs RC queue pairs, one-sided WRITEs + seqno WRITE in one post (Lamina).

Import-safe everywhere: pyverbs is imported only when the backend is used. Selecting it where no
ibverbs device exists fails at start-up with one line naming what is missing (no fallback).
Pure python on top of pyverbs (no numpy/torch needed), so the soft-RoCE VM job
(`tests/rdma/run_softroce_vm.sh`) runs it with Debian's python3.11 + python3-pyverbs.
See `README.md` here for the design, the GPU paths and what hardware they need.
"""

from __future__ import annotations

import os

from vllm_disagg.transport.base import Transport, TransportKind, TransportOptions

__all__ = ["RdmaTransport", "probe_ibverbs"]

_SYSFS_IB = "/sys/class/infiniband"


def probe_ibverbs() -> str | None:
    """None when an ibverbs device with an ACTIVE port is usable through pyverbs, else what is missing."""
    try:
        devices = sorted(os.listdir(_SYSFS_IB))
    except OSError:
        devices = []
    if not devices:
        return f"no RDMA device ({_SYSFS_IB} missing or empty: no NIC, or kernel without CONFIG_INFINIBAND/rdma_rxe)"
    try:
        import pyverbs.device as pd  # Debian's python3-pyverbs, matching the system rdma-core
    except ImportError as err:
        return f"pyverbs not importable ({err}); install the distro's python3-pyverbs (PyPI's needs rdma-core 59)"
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
        return probe_ibverbs()

    def __init__(self, options: TransportOptions):
        super().__init__(options)
        from vllm_disagg.transport.rdma.verbs import Device

        Device.get()  # open the device now: a bad port/GID fails at start-up, not mid-request

    def kv_receiver(self, name: str = "receiver"):
        from vllm_disagg.transport.rdma.kv_rx import RdmaKVReceiver

        return RdmaKVReceiver(self.options, name)

    def kv_sender(self, name: str = "sender", completion: str | None = None):
        """`completion`: "seqword" or "imm" (RDMA_WRITE_WITH_IMM); default $VLLM_DISAGG_RDMA_COMPLETION."""
        from vllm_disagg.transport.rdma.kv_tx import RdmaKVSender

        return RdmaKVSender(self.options, name, completion)

    def listen_msg(self):
        from vllm_disagg.transport.rdma.msg import RdmaMsgListener

        return RdmaMsgListener(self.options)

    def connect_msg(self, address: str, timeout: float | None = None):
        from vllm_disagg.transport.rdma.msg import connect_msg

        return connect_msg(self.options, address, timeout)
