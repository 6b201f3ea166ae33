# SPDX-License-Identifier: Apache-2.0
"""GPU-direct pieces of the `rdma` backend: device-memory registration and the device-side
seqno wait. NOT testable on the build box (no GPU, no NIC); exercised only when a GPU + RDMA
NIC machine is lent (`@pytest.mark.gpu` + `rdma`). The CPU path shares every other line.

More: README.md, "gpu.py".
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from vllm_disagg import envs
from vllm_disagg.errors import TransportUnavailable

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1
CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124


@dataclass
class GpuMR:
    """An MR over device memory: keys plus the iova verbs use for the tensor's first byte."""

    mr: Any
    iova_base: int
    fd: int = -1

    @property
    def lkey(self) -> int:
        return self.mr.lkey

    @property
    def rkey(self) -> int:
        return self.mr.rkey

    def close(self) -> None:
        self.mr.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise TransportUnavailable(f"GPU-direct RDMA needs the NVIDIA driver (libcuda.so.1): {err}") from None
    if lib.cuInit(0) != 0:
        raise TransportUnavailable("GPU-direct RDMA: cuInit failed")
    return lib


def _dmabuf_fd(lib: ctypes.CDLL, ptr: int) -> tuple[int, int]:
    """(fd, offset of ptr) for the whole CUDA allocation holding `ptr`."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        raise TransportUnavailable(f"cuMemGetAddressRange failed for 0x{ptr:x}")
    fd = ctypes.c_int(-1)
    rc = lib.cuMemGetHandleForAddressRange(
        ctypes.byref(fd), base, size, ctypes.c_int(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), ctypes.c_ulonglong(0)
    )
    if rc != 0:
        raise TransportUnavailable(f"cuMemGetHandleForAddressRange(DMA_BUF_FD) returned CUDA error {rc}")
    return fd.value, ptr - base.value


def register_gpu_memory(dev, mem, remote_write: bool) -> GpuMR:
    """Register a CUDA tensor's memory with the NIC: dma-buf first, then legacy peer memory."""
    e = dev.e
    access = e.IBV_ACCESS_LOCAL_WRITE | (e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0)
    errors = []
    try:
        from pyverbs.mr import DmaBufMR

        fd, offset = _dmabuf_fd(_libcuda(), mem.addr)
        with dev.lock:
            mr = DmaBufMR(dev.pd, mem.nbytes, access, dmabuf=fd, offset=offset)
        return GpuMR(mr, iova_base=offset, fd=fd)
    except Exception as err:  # no dmabuf support: try peer memory
        errors.append(f"dma-buf: {err}")
    try:
        return GpuMR(dev.register(mem.addr, mem.nbytes, remote_write), iova_base=mem.addr)
    except Exception as err:
        errors.append(f"peer memory (nvidia_peermem): {err}")
    raise TransportUnavailable("cannot register GPU memory with the NIC: " + "; ".join(errors))


class SeqnoWaiter:
    """Enqueue `wait until *seqword >= expect` on a CUDA stream (kernel from csrc/seqno_poll.cu).

    Load the library built by `csrc/build.sh` (`libvd_seqno.so`, or `$VLLM_DISAGG_SEQNO_LIB`).
    Needs `CUDA_MODULE_LOADING=EAGER`: under lazy loading a kernel launched for the first time
    while the wait spins blocks its launching host thread until the spin ends (seen on an H200,
    GPU kit step a), so a dead peer would hang the host for the whole spin bound."""

    def __init__(self, lib_path: str | None = None):
        loading = os.environ.get("CUDA_MODULE_LOADING", "LAZY")
        if loading.upper() != "EAGER":
            raise TransportUnavailable(
                f"device-side seqno wait needs CUDA_MODULE_LOADING=EAGER before CUDA starts (it is {loading})"
            )
        path = (
            lib_path
            or envs.seqno_lib()
            or os.path.join(os.path.dirname(__file__), "..", "..", "..", "csrc", "build", "libvd_seqno.so")
        )
        try:
            self._lib = ctypes.CDLL(os.path.abspath(path))
        except OSError as err:
            raise TransportUnavailable(
                f"seqno polling kernel library not loadable ({path}): {err}; run csrc/build.sh"
            ) from None
        self._lib.vd_seqno_wait_async.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._lib.vd_seqno_wait_async.restype = ctypes.c_int
        # Load the kernels now: a lazily loaded kernel launched while a wait spins would wait for it.
        if (rc := self._lib.vd_seqno_preload()) != 0:
            raise TransportUnavailable(f"seqno polling kernels could not be loaded: CUDA error {rc}")

    def enqueue(
        self, seqword_ptr: int, expect: int, stream_ptr: int, status_ptr: int, max_spins: int = 1 << 30
    ) -> None:
        """Launch the spin kernel on `stream_ptr`; `status_ptr` (device u32) gets 1 on timeout."""
        rc = self._lib.vd_seqno_wait_async(seqword_ptr, expect, max_spins, status_ptr, stream_ptr)
        if rc != 0:
            raise RuntimeError(f"vd_seqno_wait_async launch failed with CUDA error {rc}")
