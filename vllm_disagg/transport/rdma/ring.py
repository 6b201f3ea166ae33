# SPDX-License-Identifier: Apache-2.0
"""Seqno rings: the one mechanism behind both KV notifications and RDMA messages.

The writer puts a body into slot `seq % slots` and then the seqword `seq + 1`, both as RDMA
WRITEs in one post on one RC QP (Lamina's "data and sequence number in one post"); RC executes
WRITEs in order, so a reader that sees the seqword may read the body. The reader polls its
seqwords in host memory with the CPU (on a GPU the same word is polled by
`csrc/seqno_poll.cu`), and returns credits by WRITEing its consumed count into the writer's
credit word, so a writer never overwrites an unread slot. No CPU work at the reader is needed
for data to land; it only watches one word per peer.

More: README.md, "ring.py".
"""

from __future__ import annotations

from vllm_disagg.errors import ProtocolError
from vllm_disagg.transport.rdma.proto import SEQWORD, QpInfo
from vllm_disagg.transport.rdma.verbs import Device, Endpoint, HostBuffer

CREDIT_WR_ID = (1 << 64) - 1  # wr_id of credit-return WRITEs (never a ring seq)


class CreditWord:
    """A u64 the peer's reader WRITEs its consumed count into (writer side)."""

    def __init__(self, dev: Device):
        self.buf = HostBuffer(8)
        self.mr = dev.register(self.buf.addr, 8, remote_write=True)

    def fields(self) -> dict[str, int]:
        return {"credit_addr": self.buf.addr, "credit_rkey": self.mr.rkey}

    def consumed(self) -> int:
        return SEQWORD.unpack_from(self.buf.view)[0]

    def close(self) -> None:
        self.mr.close()
        self.buf.close()


class RingReader:
    """The receiving ring for one peer: `slots` bodies of `slot_bytes` + `slots` seqwords."""

    def __init__(self, dev: Device, slots: int, slot_bytes: int, imm: bool = False):
        self.slots, self.slot_bytes, self.imm = slots, slot_bytes, imm
        self.landed_count = 0  # imm mode: receive CQEs seen (slots known to be placed)
        self.buf = HostBuffer(slots * slot_bytes + slots * SEQWORD.size)
        self.mr = dev.register(self.buf.addr, self.buf.nbytes, remote_write=True)
        self._credit_src = HostBuffer(8)
        self._credit_mr = dev.register(self._credit_src.addr, 8)
        self.next_seq = 0
        self._returned = 0

    def fields(self) -> dict[str, int]:
        return {
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "ring_addr": self.buf.addr,
            "ring_rkey": self.mr.rkey,
        }

    def landed(self, imm: int, peer: str) -> None:
        """imm mode: a receive CQE for the next unseen seq (RC delivers them in seq order)."""
        if imm != self.landed_count & 0xFFFFFFFF:
            raise ProtocolError(
                f"rdma write-with-imm from {peer}: imm {imm}, want {self.landed_count & 0xFFFFFFFF}"
            )
        self.landed_count += 1

    def peek(self) -> memoryview | None:
        """The body of the next slot if its seqword (or, imm mode, its receive CQE) says it was
        written, else None."""
        slot = self.next_seq % self.slots
        if self.imm:
            if self.next_seq >= self.landed_count:
                return None
        else:
            word = SEQWORD.unpack_from(self.buf.view, self.slots * self.slot_bytes + slot * SEQWORD.size)[0]
            if word != self.next_seq + 1:
                return None
        return self.buf.view[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def consume(self) -> None:
        self.next_seq += 1

    def return_credits(self, ep: Endpoint, remote: QpInfo) -> bool:
        """WRITE the consumed count into the writer's credit word; True if a WR was posted."""
        if self.next_seq == self._returned:
            return False
        SEQWORD.pack_into(self._credit_src.view, 0, self.next_seq)
        ep.post_writes(
            [(self._credit_src.addr, 8, self._credit_mr.lkey, remote.credit_addr, remote.credit_rkey)],
            CREDIT_WR_ID,
        )
        self._returned = self.next_seq
        return True

    def close(self) -> None:
        self.mr.close()
        self._credit_mr.close()
        self.buf.close()
        self._credit_src.close()


class RingWriter:
    """The sending side of a peer's ring: local staging slots and the credit word."""

    def __init__(self, dev: Device, remote: QpInfo, credit: CreditWord):
        if remote.slots < 1 or remote.slot_bytes < 64:
            raise ValueError(f"peer ring too small ({remote.slots} x {remote.slot_bytes})")
        self.remote, self.credit = remote, credit
        self.slots, self.slot_bytes = remote.slots, remote.slot_bytes
        self.staging = HostBuffer(self.slots * (self.slot_bytes + SEQWORD.size))
        self.mr = dev.register(self.staging.addr, self.staging.nbytes)
        self.next_seq = 0

    def has_room(self) -> bool:
        return self.next_seq - self.credit.consumed() < self.slots

    def body(self) -> memoryview:
        """The staging body of the next slot (fill it, then `writes(nbytes)`)."""
        slot = self.next_seq % self.slots
        return self.staging.view[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]

    def writes(self, nbytes: int, seqword: bool = True) -> list[tuple[int, int, int, int, int]]:
        """WRITE(body[:nbytes]) + WRITE(seqword) for the next slot; advances the seq. With
        `seqword=False` (imm mode) only the body WRITE: the caller posts it WITH_IMM(seq)."""
        seq, slot = self.next_seq, self.next_seq % self.slots
        word_off = self.slots * self.slot_bytes + slot * SEQWORD.size
        SEQWORD.pack_into(self.staging.view, word_off, seq + 1)
        lkey, r = self.mr.lkey, self.remote
        self.next_seq += 1
        out = []
        if nbytes:
            out.append(
                (
                    self.staging.addr + slot * self.slot_bytes,
                    nbytes,
                    lkey,
                    r.ring_addr + slot * self.slot_bytes,
                    r.ring_rkey,
                )
            )
        if not seqword:
            if not nbytes:
                raise ValueError("an imm-completed ring write needs a body")
            return out
        word_raddr = r.ring_addr + self.slots * self.slot_bytes + slot * SEQWORD.size
        out.append((self.staging.addr + word_off, SEQWORD.size, lkey, word_raddr, r.ring_rkey))
        return out

    def close(self) -> None:
        self.mr.close()
        self.staging.close()
