# SPDX-License-Identifier: Apache-2.0
"""KV push over RC queue pairs: one-sided RDMA WRITEs straight into the decode side's registered
KV cache, followed in the same post by a notification body + seqno WRITE into a per-peer ring.

Receiver: regions are registered once (`register_region`, an MR per KV tensor); `start()` opens
the authenticated control listener; each sender gets its own RC QP and ring. A poller thread
watches every peer's next seqword (CPU polling of host memory) and turns ready slots into
`Notification`s, in seq order, then returns credits by an RDMA WRITE.

More: README.md, "kv.py".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_disagg.transport.base import RegionInfo
from vllm_disagg.transport.onesided.runs import block_runs, plan_block_write  # noqa: F401 (re-export)
from vllm_disagg.transport.rdma.verbs import Device, memory_of

logger = logging.getLogger(__name__)

SERVICE = b"rdma-kv"
NOTIF_SLOTS = 64
MAX_CHAIN_WRS = 128  # data WRs per post; longer jobs are posted in several chains
PEER_CHECK_S = 0.1


@dataclass
class Region:
    info: RegionInfo
    addr: int
    mr: Any
    keepalive: Any


def register_memory(dev: Device, obj: Any, remote_write: bool):
    """(HostMemory, MR) for a tensor/buffer; CUDA tensors go through the GPU-direct path."""
    mem = memory_of(obj)
    if mem.is_gpu:
        from vllm_disagg.transport.rdma.gpu import register_gpu_memory

        return mem, register_gpu_memory(dev, mem, remote_write)
    return mem, dev.register(mem.addr, mem.nbytes, remote_write)


def verbs_addr(mem, mr) -> int:
    """The address verbs use for `mem`: its virtual address, or the iova of a dmabuf MR."""
    return getattr(mr, "iova_base", mem.addr)
