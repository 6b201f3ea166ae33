# SPDX-License-Identifier: Apache-2.0
"""A thin layer over pyverbs (rdma-core's own bindings): one device context per process, memory
registration, and RC queue pairs that post chains of RDMA WRITEs.

Why this shape: the backend needs exactly four verbs operations (register memory, bring an RC QP
to RTS from the peer's QPN/GID/PSN, post a WRITE chain with only its last WR signalled, poll the
CQ), so they live here and nothing else touches pyverbs. pyverbs is imported lazily so
`vllm_disagg.transport.rdma` imports on machines without rdma-core. No numpy/torch needed: host
buffers are addressed through ctypes, which lets the soft-RoCE VM run this with Debian's python.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import socket
import threading
from typing import Any

from vllm_disagg import envs
from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport.onesided.memory import HostMemory, memory_of  # noqa: F401 - re-exported
from vllm_disagg.transport.rdma.proto import QpInfo

MAX_WRITE_BYTES = 1 << 30  # split longer runs (rxe and most HCAs cap max_msg_sz at 2 GiB)
RECV_WR_ID = (1 << 64) - 2  # wr_id of the zero-SGE receives that WRITE_WITH_IMM consumes

# ibv_wc_status values worth naming in an error message (verbs.h).
WC_STATUS = {
    0: "SUCCESS",
    1: "LOC_LEN_ERR",
    2: "LOC_QP_OP_ERR",
    3: "LOC_EEC_OP_ERR",
    4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR",
    6: "MW_BIND_ERR",
    7: "BAD_RESP_ERR",
    8: "LOC_ACCESS_ERR",
    9: "REM_INV_REQ_ERR",
    10: "REM_ACCESS_ERR",
    11: "REM_OP_ERR",
    12: "RETRY_EXC_ERR",
    13: "RNR_RETRY_EXC_ERR",
    16: "REM_ABORT_ERR",
    19: "FATAL_ERR",
    20: "RESP_TIMEOUT_ERR",
    21: "GENERAL_ERR",
}


def wc_status_name(status: int) -> str:
    return WC_STATUS.get(status, f"status {status}")


def gid_to_bytes(gid: str) -> bytes:
    raw = bytes.fromhex(gid.replace(":", ""))
    if len(raw) != 16:
        raise ValueError(f"bad GID {gid!r}")
    return raw


def gid_to_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i : i + 4] for i in range(0, 32, 4))


class HostBuffer:
    """Page-aligned anonymous memory (rings, credit words, staging) with a stable address."""

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 8)
        self._mmap = mmap.mmap(-1, self.nbytes)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        if self._mmap is None:
            return
        self.view.release()
        del self._anchor
        self._mmap.close()
        self._mmap = None


class Device:
    """The process's ibv context + PD on one port/GID, opened once (`Device.get()`)."""

    _instance: Device | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> Device:
        """The process's device; a forked child opens its own (verbs contexts do not survive fork)."""
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        import pyverbs.device as d
        import pyverbs.enums as e
        from pyverbs.pd import PD

        self.e = e
        names = [dev.name.decode() for dev in d.get_device_list()]
        want = envs.rdma_device() or (names[0] if names else "")
        if want not in names:
            raise TransportUnavailable(f"rdma device {want!r} not found (devices: {names or 'none'})")
        self.name = want
        self.ctx = d.Context(name=want)
        self.port = envs.rdma_port()
        port_attr = self.ctx.query_port(self.port)
        if port_attr.state != e.IBV_PORT_ACTIVE:
            raise TransportUnavailable(
                f"rdma device {want} port {self.port} is not ACTIVE (state {port_attr.state})"
            )
        self.mtu = int(port_attr.active_mtu)
        self.gid_index = self._pick_gid()
        self.gid = gid_to_bytes(self.ctx.query_gid(self.port, self.gid_index).gid)
        self.pd = PD(self.ctx)
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def _pick_gid(self) -> int:
        """Env override, else an IPv4-mapped RoCEv2 GID if any, else the first non-zero GID."""
        if envs.rdma_gid_index() is not None:
            return envs.rdma_gid_index()
        first = None
        for i in range(16):
            try:
                gid = self.ctx.query_gid(self.port, i).gid
            except Exception:
                break
            if gid.replace(":", "").strip("0") == "":
                continue
            if gid.startswith("0000:0000:0000:0000:0000:ffff"):
                return i
            first = i if first is None else first
        if first is None:
            raise TransportUnavailable(f"rdma device {self.name} port {self.port} has no usable GID")
        return first

    def register(self, addr: int, nbytes: int, remote_write: bool = False):
        """An MR over caller memory (`address=`): the memory is not copied or owned."""
        from pyverbs.mr import MR

        access = self.e.IBV_ACCESS_LOCAL_WRITE | (self.e.IBV_ACCESS_REMOTE_WRITE if remote_write else 0)
        with self.lock:
            return MR(self.pd, nbytes, access, address=addr)


class Endpoint:
    """One RC QP with its own CQ. Posts WRITE chains; only the chain's last WR is signalled.

    `max_recv_wr` > 1 is for a receiver of RDMA_WRITE_WITH_IMM: each such WRITE consumes one
    posted (zero-SGE) receive and yields a receive CQE carrying the immediate."""

    def __init__(self, dev: Device, max_send_wr: int = 512, max_recv_wr: int = 1):
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        e = dev.e
        self.dev, self.e = dev, e
        self.max_send_wr = max_send_wr
        with dev.lock:
            self.cq = CQ(dev.ctx, max_send_wr * 2 + max_recv_wr, None, None, 0)
            cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
            attr = QPAttr(port_num=dev.port)
            attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            self.qp = QP(dev.pd, init, attr)  # -> INIT
        self.psn = random.getrandbits(24)
        self._scratch: tuple[HostBuffer, Any] | None = None
        self._closed = False

    def info(self, **ring: int) -> QpInfo:
        return QpInfo(self.qp.qp_num, self.psn, self.dev.gid, self.dev.mtu, **ring)

    def connect(self, remote: QpInfo) -> None:
        """INIT -> RTR -> RTS towards `remote` (RoCE: global route to its GID)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.dev.port)
        attr.path_mtu = min(self.dev.mtu, remote.mtu)
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per retry; 7 retries -> a dead peer errors in ~0.5 s
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(gid_to_str(remote.gid)), sgid_index=self.dev.gid_index)
        attr.ah_attr = AHAttr(port_num=self.dev.port, is_global=1, gr=gr)
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        self.qp.to_rts(attr)

    def post_writes(
        self, writes: list[tuple[int, int, int, int, int]], wr_id: int, imm: int | None = None
    ) -> None:
        """Post `(laddr, length, lkey, raddr, rkey)` WRITEs as one chain; the last is signalled
        with `wr_id`. RC executes them in order, so the last one completing means all landed.
        With `imm`, the last WR is RDMA_WRITE_WITH_IMM carrying `imm` (u32): the receiver learns
        of it from a receive CQE, generated only once the data before it is placed."""
        from pyverbs.wr import SGE, SendWR

        e = self.e
        wrs, nxt = [], None
        for i in range(len(writes) - 1, -1, -1):
            laddr, length, lkey, raddr, rkey = writes[i]
            last = i == len(writes) - 1
            with_imm = last and imm is not None
            wr = SendWR(
                wr_id=wr_id if last else 0,
                opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM if with_imm else e.IBV_WR_RDMA_WRITE,
                num_sge=1,
                imm_data=socket.htonl(imm & 0xFFFFFFFF) if with_imm else 0,
                sg=[SGE(laddr, length, lkey)],
                send_flags=e.IBV_SEND_SIGNALED if last else 0,
                next_wr=nxt,
            )
            wr.set_wr_rdma(rkey, raddr)
            wrs.append(wr)  # pyverbs links raw pointers: keep every WR alive until posted
            nxt = wr
        self.qp.post_send(nxt)

    def post_recvs(self, count: int) -> None:
        """Post `count` receives (wr_id RECV_WR_ID), one per expected WRITE_WITH_IMM. A WRITE_WITH_IMM
        places no bytes through the receive, but pyverbs wants one SGE: an 8-byte scratch MR."""
        from pyverbs.wr import SGE, RecvWR

        if self._scratch is None:
            buf = HostBuffer(8)
            self._scratch = (buf, self.dev.register(buf.addr, 8))
        buf, mr = self._scratch
        wrs, nxt = [], None
        for _ in range(count):
            nxt = RecvWR(wr_id=RECV_WR_ID, num_sge=1, sg=[SGE(buf.addr, 8, mr.lkey)], next_wr=nxt)
            wrs.append(nxt)  # keep every WR alive until posted
        if nxt is not None:
            self.qp.post_recv(nxt)

    def poll(self, max_entries: int = 16) -> list[tuple[int, int]]:
        """(wr_id, status) of completed signalled WRs."""
        return [(wr_id, status) for wr_id, status, _ in self.poll_imm(max_entries)]

    def poll_imm(self, max_entries: int = 16) -> list[tuple[int, int, int]]:
        """(wr_id, status, imm) of completions; imm is meaningful for successful receives only
        (wr_id RECV_WR_ID; an errored WC's opcode is undefined, so the wr_id tells them apart)."""
        _, wcs = self.cq.poll(max_entries)
        return [(wc.wr_id, wc.status, socket.ntohl(wc.imm_data & 0xFFFFFFFF)) for wc in wcs]

    def to_error(self) -> None:
        """Force the QP into ERR (flushes outstanding WRs; used on teardown and in tests)."""
        from pyverbs.qp import QPAttr

        attr = QPAttr()
        attr.qp_state = self.e.IBV_QPS_ERR
        try:
            self.qp.modify(attr, self.e.IBV_QP_STATE)
        except Exception:  # already destroyed/errored
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.dev.lock:
            self.qp.close()
            self.cq.close()
        if self._scratch is not None:
            self._scratch[1].close()
            self._scratch[0].close()


def split_write(
    laddr: int, length: int, lkey: int, raddr: int, rkey: int
) -> list[tuple[int, int, int, int, int]]:
    """One logical WRITE as WRs of at most MAX_WRITE_BYTES."""
    out = []
    for off in range(0, length, MAX_WRITE_BYTES):
        n = min(MAX_WRITE_BYTES, length - off)
        out.append((laddr + off, n, lkey, raddr + off, rkey))
    return out
