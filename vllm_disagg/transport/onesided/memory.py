# SPDX-License-Identifier: Apache-2.0
"""Addressing a caller's tensor or buffer without copying, for the one-sided backends (`rdma`
registers it with the NIC, `mscclpp` with its fabric). ctypes only: no numpy/torch import."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any


@dataclass
class HostMemory:
    """Where a caller's tensor/buffer lives: address, size, leading dim, and what keeps it alive."""

    addr: int
    nbytes: int
    num_blocks: int
    keepalive: Any
    is_gpu: bool = False


def memory_of(obj: Any) -> HostMemory:
    """Address a contiguous `[num_blocks, ...]` torch tensor or writable buffer without copying.

    Torch tensors (CPU or CUDA) give `data_ptr()`; anything else goes through the buffer protocol
    (memoryview, mmap, bytearray, numpy) and ctypes. CUDA tensors are flagged `is_gpu` and need
    the dmabuf path (`gpu.py`)."""
    if hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise ValueError(f"tensor {tuple(obj.shape)} is not contiguous; pass .contiguous()")
        if obj.dim() < 1:
            raise ValueError("a region/source tensor must be [num_blocks, ...]")
        nbytes = obj.numel() * obj.element_size()
        return HostMemory(obj.data_ptr(), nbytes, int(obj.shape[0]), obj, obj.device.type == "cuda")
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if view.readonly:
        raise ValueError("rdma needs a writable buffer (it is registered with the NIC)")
    if view.ndim < 1 or view.nbytes == 0:
        raise ValueError("a region/source buffer must be non-empty [num_blocks, ...]")
    anchor = ctypes.c_char.from_buffer(view)
    return HostMemory(ctypes.addressof(anchor), view.nbytes, view.shape[0], (view, anchor))
