# SPDX-License-Identifier: Apache-2.0
"""The side-channel codec and the compatibility check of the KV push handshake."""

from __future__ import annotations

import dataclasses
import json
import struct
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.errors import HandshakeMismatch, ProtocolError
from vllm_disagg.kv.handshake import (
    PROTOCOL_VERSION,
    HandshakeInfo,
    MsgType,
    SideMsg,
    VersionMismatch,
    check_compatible,
    decode_msg,
    encode_msg,
    handshake_body,
    legacy_reject,
)
from vllm_disagg.observe.context import TraceContext

INFO = HandshakeInfo(model="m", dtype="float32", block_size=32, kv_layout="cpu:float32(2, 32, 64)",
                     num_layers=2, num_kv_heads=2, head_size=32, block_nbytes=16384)


def test_a_register_message_round_trips_with_its_block_ids():
    body = {**handshake_body(INFO, "tok", "tid-1"), "address": "127.0.0.1:1", "start_block": 0}
    msg = decode_msg(encode_msg(SideMsg(MsgType.REGISTER, body, (5, 7, 9))))
    assert msg.type is MsgType.REGISTER and msg.block_ids == (5, 7, 9) and msg.transfer_id == "tid-1"
    check_compatible(INFO, msg.body, "tok", "tid-1", "peer")


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(HandshakeInfo)])
def test_every_handshake_field_mismatch_is_named_in_the_error(field):
    value = getattr(INFO, field)
    other = dataclasses.replace(INFO, **{field: value + 1 if isinstance(value, int) else value + "x"})
    with pytest.raises(HandshakeMismatch) as err:
        check_compatible(INFO, handshake_body(other, "tok", "t"), "tok", "t", "10.0.0.1:9")
    assert err.value.field == field and repr(field) in str(err.value) and "10.0.0.1:9" in str(err.value)


def test_a_peer_with_another_token_fails_the_auth_field_and_the_token_is_never_sent():
    body = handshake_body(INFO, "other-token", "t")
    assert "other-token" not in encode_msg(SideMsg(MsgType.REGISTER, body)).decode(errors="replace")
    with pytest.raises(HandshakeMismatch) as err:
        check_compatible(INFO, body, "tok", "t", "p")
    assert err.value.field == "auth"


def test_a_different_protocol_version_is_refused_before_anything_else():
    body = {**handshake_body(INFO, "tok", "t"), "protocol_version": PROTOCOL_VERSION + 1}
    with pytest.raises(HandshakeMismatch, match="protocol_version"):
        check_compatible(INFO, body, "tok", "t", "p")


def _hdr(magic=b"DGKV", version=PROTOCOL_VERSION, mtype=1, body_len=0, num_ids=0, trace_len=0) -> bytes:
    return struct.pack("!4sHHIIB", magic, version, mtype, body_len, num_ids, trace_len)


@pytest.mark.parametrize(
    "frame, why",
    [
        (b"", "shorter than the header"),
        (_hdr(b"XXXX"), "bad magic"),
        (_hdr(version=99), f"protocol version 99, this side speaks {PROTOCOL_VERSION}"),
        (_hdr(mtype=77), "unknown type"),
        (_hdr(body_len=10) + b"{}", "header says"),
        (_hdr(body_len=2) + b"[]", "flat JSON object"),
        (_hdr(body_len=2, num_ids=1) + b"{}" + struct.pack("<i", -1), "negative"),
        (_hdr(body_len=2, trace_len=7) + b"{}" + bytes(7), "7-byte trace context"),
        (_hdr(mtype=int(MsgType.CANCEL), body_len=2, trace_len=25) + b"{}" + bytes(25), "trace context on type 4"),
        (_hdr(body_len=2, trace_len=25) + b"{}" + bytes(25), "not all zero"),
        (_hdr(body_len=4000) + b"[" * 4000, "not JSON"),
    ],
)
def test_malformed_frames_are_rejected_with_a_reason(frame, why):
    with pytest.raises(ProtocolError, match=why):
        decode_msg(frame, "1.2.3.4:5")


TRACE = TraceContext(bytes(range(1, 17)), bytes(range(1, 9)), 1)


def test_register_carries_the_trace_context_and_other_types_refuse_one():
    body = {**handshake_body(INFO, "tok", "tid-1"), "address": "127.0.0.1:1", "start_block": 0}
    msg = decode_msg(encode_msg(SideMsg(MsgType.REGISTER, body, (5,), TRACE)))
    assert msg.trace == TRACE and msg.block_ids == (5,)
    assert decode_msg(encode_msg(SideMsg(MsgType.REGISTER, body, (5,)))).trace is None
    with pytest.raises(ValueError, match="only REGISTER"):
        encode_msg(SideMsg(MsgType.CANCEL, {"transfer_id": "t"}, (), TRACE))


def test_a_version_1_peer_is_refused_in_its_own_layout_naming_both_versions():
    body = json.dumps({"transfer_id": "tid-old", "protocol_version": 1}).encode()
    old = struct.pack("!4sHHII", b"DGKV", 1, int(MsgType.REGISTER), len(body), 0) + body
    with pytest.raises(VersionMismatch) as err:
        decode_msg(old, "10.0.0.2:7")
    assert f"protocol version 1, this side speaks {PROTOCOL_VERSION}" in str(err.value) and "10.0.0.2:7" in str(err.value)
    reply = legacy_reject(old, err.value)
    magic, version, mtype, body_len, num_ids = struct.unpack_from("!4sHHII", reply)
    assert (magic, version, mtype, num_ids) == (b"DGKV", 1, MsgType.REJECT, 0)
    answer = json.loads(reply[16:16 + body_len])
    assert answer["transfer_id"] == "tid-old" and answer["field"] == "protocol_version"
    assert "version 1" in answer["message"] and f"speaks {PROTOCOL_VERSION}" in answer["message"]
    assert legacy_reject(b"DGKV\x00\x07", VersionMismatch(7, "p")) is None  # layouts we never knew


@pytest.mark.parametrize("version", [2, 3])
def test_a_version_2_or_3_peer_is_refused_in_its_own_layout_which_later_versions_kept(version):
    body = json.dumps({"transfer_id": "tid-old", "protocol_version": version}).encode()
    old = struct.pack("!4sHHIIB", b"DGKV", version, int(MsgType.REGISTER), len(body), 0, 0) + body
    with pytest.raises(VersionMismatch) as err:
        decode_msg(old, "10.0.0.2:7")
    reply = legacy_reject(old, err.value)
    magic, got_version, mtype, body_len, num_ids, trace_len = struct.unpack_from("!4sHHIIB", reply)
    assert (magic, got_version, mtype, num_ids, trace_len) == (b"DGKV", version, MsgType.REJECT, 0, 0)
    answer = json.loads(reply[17:17 + body_len])
    assert answer["transfer_id"] == "tid-old" and answer["field"] == "protocol_version"


def test_verify_and_checksums_round_trip_and_checksums_are_checked_before_use():
    from vllm_disagg.transport import checksum

    for mtype, body in ((MsgType.VERIFY, {"transfer_id": "t"}),
                        (MsgType.CHECKSUMS, {"transfer_id": "t", "crc32": checksum.encode([1, 0xFFFFFFFF])}),
                        (MsgType.STATUS, {"transfer_id": "t"}),
                        (MsgType.STATE, {"transfer_id": "t", "state": "failed", "message": "why"})):
        msg = decode_msg(encode_msg(SideMsg(mtype, body)))
        assert msg.type is mtype and msg.body == body
    assert checksum.decode("00000001,ffffffff", 2) == [1, 0xFFFFFFFF]
    for bad in ("00000001", "1,2", "zzzzzzzz,00000000", None, 7):
        with pytest.raises(ValueError):
            checksum.decode(bad, 2)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_either_decode_or_raise_protocol_error(data):
    try:
        decode_msg(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 40))
def test_corrupting_a_valid_frame_never_escapes_as_another_exception(junk, pos):
    frame = bytearray(encode_msg(SideMsg(MsgType.REGISTER, handshake_body(INFO, "tok", "t"), (1, 2))))
    frame[pos : pos + len(junk)] = junk
    try:
        decode_msg(bytes(frame))
    except ProtocolError:
        pass


def test_stats_aggregate_reduce_and_export_the_disagg_kv_prometheus_metrics():
    import prometheus_client as prom

    from vllm_disagg.kv.stats import DisaggKVConnectorStats, DisaggKVPromMetrics

    a, b = DisaggKVConnectorStats(), DisaggKVConnectorStats()
    a.record_layer(1 << 20, 0.01)
    a.record_request(0.05, 0.002)
    b.record_fallback()
    b.record_handshake_failure()
    merged = a.aggregate(b.clone_and_reset())
    assert b.is_empty() and not merged.is_empty()
    summary = merged.reduce()
    assert summary["MB pushed"] == 1.0 and summary["Num fallbacks"] == 1
    types = {prom.Gauge: prom.Gauge, prom.Counter: prom.Counter, prom.Histogram: prom.Histogram}
    metrics = DisaggKVPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    metrics.observe(merged.data, engine_idx=0)
    text = prom.generate_latest().decode()
    for name in ("vllm:disagg_kv_bytes_pushed_total", "vllm:disagg_kv_layer_transfer_seconds_bucket",
                 "vllm:disagg_kv_request_transfer_seconds_count", "vllm:disagg_kv_exposed_transfer_seconds_sum",
                 "vllm:disagg_kv_fallbacks_total", "vllm:disagg_kv_handshake_failures_total"):
        assert name in text
    assert 'vllm:disagg_kv_bytes_pushed_total{engine="0"} 1.048576e+06' in text
