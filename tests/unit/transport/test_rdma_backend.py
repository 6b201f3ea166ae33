# SPDX-License-Identifier: Apache-2.0
"""The `rdma` backend without a device: the start-up error, its wire payloads and block planning.

Its data path runs in `tests/rdma/rdma_cases.py` (soft-RoCE VM job, or natively where a device
exists: `test_rdma_native.py`); here we test what is shared with that path and needs no NIC.
"""

from __future__ import annotations

import ctypes
import mmap
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.errors import ProtocolError, TransportUnavailable
from vllm_disagg.transport import TransportOptions, get_transport
from vllm_disagg.transport.rdma import RdmaTransport, probe_ibverbs, proto
from vllm_disagg.transport.rdma.kv import block_runs
from vllm_disagg.transport.rdma.verbs import HostBuffer, gid_to_bytes, gid_to_str, memory_of, split_write

OPTS = TransportOptions(auth_token="t")
no_device = pytest.mark.skipif(probe_ibverbs() is None, reason="an ibverbs device is present")
INFO = proto.QpInfo(
    0x1234, 0xABCDE, bytes(range(16)), 3, proto.FLAG_IMM, 64, 256, 0x7F0000001000, 77, 0x7F0000002000, 78
)


@no_device
def test_selecting_rdma_without_a_device_fails_with_one_line_naming_what_is_missing():
    with pytest.raises(TransportUnavailable) as err:
        get_transport("rdma", OPTS)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("transport 'rdma' cannot run here: ")
    assert "/sys/class/infiniband" in msg or "pyverbs" in msg
    assert RdmaTransport.unavailable_reason() == probe_ibverbs()


def test_rdma_and_mscclpp_each_answer_doctor_in_one_line():
    from vllm_disagg.transport.mscclpp import MscclppTransport

    for cls in (RdmaTransport, MscclppTransport):
        line = cls.doctor()
        assert "\n" not in line and (line.startswith("yes (") or line.startswith("no - ")), line
    assert RdmaTransport.doctor() == f"no - {probe_ibverbs()}" or probe_ibverbs() is None


def test_qp_info_hello_and_region_table_round_trip():
    info, end = proto.QpInfo.unpack_from(INFO.pack(), 0, "p")
    assert info == INFO and end == len(INFO.pack())
    sid = b"s" * proto.SESSION_ID_BYTES
    assert proto.parse_hello(proto.pack_hello(sid, "prefill-0", INFO), "p") == (sid, "prefill-0", INFO)
    regions = [proto.RemoteRegion(f"layer.{i}", 10 + i, 4096, 0x1000 * i, i) for i in range(3)]
    raw = INFO.pack() + proto.pack_regions(regions)
    _, pos = proto.QpInfo.unpack_from(raw, 0, "p")
    assert proto.parse_regions(raw, pos, "p") == regions


@pytest.mark.parametrize(
    "raw, why",
    [
        (INFO.pack()[:-1], "truncated"),
        (struct.pack("<H", 99) + INFO.pack()[2:], "version"),
        (INFO.pack()[:2] + struct.pack("<I", 0) + INFO.pack()[6:], "invalid"),
        (INFO.pack()[:27] + b"\x80" + INFO.pack()[28:], "unknown flags"),
    ],
)
def test_bad_qp_info_is_a_protocol_error(raw, why):
    with pytest.raises(ProtocolError, match=why):
        proto.QpInfo.unpack_from(raw, 0, "peer")


def test_hello_and_region_table_reject_trailing_or_missing_bytes():
    hello = proto.pack_hello(b"s" * 16, "x", INFO)
    with pytest.raises(ProtocolError, match="trailing"):
        proto.parse_hello(hello + b"!", "p")
    table = proto.pack_regions([proto.RemoteRegion("a", 1, 2, 3, 4)])
    with pytest.raises(ProtocolError, match="trailing"):
        proto.parse_regions(table + b"?", 0, "p")
    with pytest.raises(ProtocolError):
        proto.parse_regions(table[:-1], 0, "p")
    with pytest.raises(ProtocolError, match="regions"):
        proto.parse_regions(struct.pack("<I", proto.MAX_REGIONS + 1), 0, "p")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_control_payloads_raise_protocol_errors_only(raw):
    for parse in (lambda: proto.parse_hello(raw, "p"), lambda: proto.parse_regions(raw, 0, "p")):
        try:
            parse()
        except ProtocolError:
            pass


def test_notification_slot_round_trips_and_checks_seq_and_tid():
    body = memoryview(bytearray(proto.NOTIF_SLOT_BYTES))
    proto.pack_notif(body, 41, 7, 123456, "req-ü".encode())
    assert proto.parse_notif(body, 41, "p") == (7, 123456, "req-ü")
    with pytest.raises(ProtocolError, match="want 42"):
        proto.parse_notif(body, 42, "p")
    proto.NOTIF_BODY.pack_into(body, 0, 41, 0, 0, proto.MAX_TID_BYTES + 1)
    with pytest.raises(ProtocolError, match="tid_len"):
        proto.parse_notif(body, 41, "p")


def test_block_runs_merge_only_where_both_sides_are_consecutive():
    assert block_runs([0, 1, 2, 3, 10, 11, 30], [47, 46, 45, 44, 0, 1, 20]) == [
        (0, 47, 1),
        (1, 46, 1),
        (2, 45, 1),
        (3, 44, 1),
        (10, 0, 2),
        (30, 20, 1),
    ]
    assert block_runs([5, 6, 7], [1, 2, 3]) == [(5, 1, 3)]
    assert block_runs([], []) == []


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_block_runs_cover_exactly_the_requested_pairs_in_order(pairs):
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    expanded = [(s + k, d + k) for s, d, n in block_runs(src, dst) for k in range(n)]
    assert expanded == list(zip(src, dst))


def test_long_runs_split_into_writes_the_nic_accepts():
    parts = split_write(1000, (3 << 30) + 5, 1, 5000, 2)
    assert [p[1] for p in parts] == [1 << 30, 1 << 30, 1 << 30, 5]
    assert parts[1][0] == 1000 + (1 << 30) and parts[1][3] == 5000 + (1 << 30)


def test_memory_of_addresses_buffers_and_tensors_without_copying():
    import torch

    buf = mmap.mmap(-1, 4 * 1024)
    view = memoryview(buf).cast("B", (4, 1024))
    mem = memory_of(view)
    assert (mem.num_blocks, mem.nbytes) == (4, 4096)
    ctypes.memmove(mem.addr + 1024, b"hello", 5)  # writes land in the caller's memory
    assert buf[1024:1029] == b"hello"
    t = torch.zeros(8, 3, 4)
    tm = memory_of(t)
    assert (tm.addr, tm.nbytes, tm.num_blocks, tm.is_gpu) == (t.data_ptr(), 384, 8, False)
    with pytest.raises(ValueError, match="contiguous"):
        memory_of(t.transpose(0, 1))
    with pytest.raises(ValueError, match="writable"):
        memory_of(b"read-only")


def test_host_buffers_are_page_aligned_and_gids_convert_both_ways():
    hb = HostBuffer(100)
    assert hb.addr % mmap.PAGESIZE == 0 and hb.view.nbytes >= 100
    hb.close()
    gid = "fe80:0000:0000:0000:5054:00ff:fe12:3456"
    assert gid_to_str(gid_to_bytes(gid)) == gid


def test_imm_completion_is_a_qp_info_flag_next_to_the_mtu():
    raw = INFO.pack()
    assert raw[26] == 3 and raw[27] == proto.FLAG_IMM  # version(2) qpn(4) psn(4) gid(16) mtu flags
    plain = proto.QpInfo(1, 2, bytes(16), 3)
    assert proto.QpInfo.unpack_from(plain.pack(), 0, "p")[0].flags == 0


def test_rdma_completion_env_accepts_seqword_and_imm_only(monkeypatch):
    from vllm_disagg import envs

    monkeypatch.delenv(envs.VLLM_DISAGG_RDMA_COMPLETION, raising=False)
    assert envs.rdma_completion() == "seqword"
    monkeypatch.setenv(envs.VLLM_DISAGG_RDMA_COMPLETION, "IMM")
    assert envs.rdma_completion() == "imm"
    monkeypatch.setenv(envs.VLLM_DISAGG_RDMA_COMPLETION, "write_with_imm")
    with pytest.raises(ValueError, match="VLLM_DISAGG_RDMA_COMPLETION"):
        envs.rdma_completion()


def test_seqno_waiter_refuses_lazy_cuda_module_loading(monkeypatch):
    """A lazily loaded kernel launched behind a spinning wait blocks the host (seen on an H200)."""
    from vllm_disagg.transport.rdma.gpu import SeqnoWaiter

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    with pytest.raises(TransportUnavailable, match="CUDA_MODULE_LOADING=EAGER"):
        SeqnoWaiter("/nonexistent/libvd_seqno.so")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    with pytest.raises(TransportUnavailable, match="not loadable"):
        SeqnoWaiter("/nonexistent/libvd_seqno.so")
