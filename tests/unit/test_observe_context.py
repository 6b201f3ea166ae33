# SPDX-License-Identifier: Apache-2.0
"""`TraceContext`: the 25-byte wire form and the W3C `traceparent` header, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_disagg.errors import ProtocolError
from vllm_disagg.observe.context import TRACE_CONTEXT_BYTES, TraceContext
from vllm_disagg.transport.wire import FRAME_HDR, FrameType, pack_frame, parse_frame_header

HEADER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_traceparent_header_round_trips_through_the_25_byte_wire_form():
    tc = TraceContext.from_traceparent(HEADER)
    assert tc.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and tc.parent_span_id.hex() == "00f067aa0ba902b7"
    assert tc.sampled and len(tc.to_bytes()) == TRACE_CONTEXT_BYTES == 25
    assert TraceContext.from_bytes(tc.to_bytes()) == tc and tc.to_traceparent() == HEADER
    assert TraceContext.from_headers({"TraceParent": HEADER, "x": "y"}) == tc
    assert TraceContext.from_headers(None) is None and TraceContext.from_headers({}) is None


@pytest.mark.parametrize("header", [
    None, "", "garbage", HEADER.replace("-01", "-1"), "ff" + HEADER[2:],  # version ff is forbidden
    HEADER.replace("4bf92f3577b34da6a3ce929d0e0e4736", "0" * 32),  # all-zero trace id
    HEADER.replace("00f067aa0ba902b7", "0" * 16),  # all-zero parent id
    HEADER + "-extra",  # version 00 has exactly four fields
])
def test_an_invalid_traceparent_is_ignored_never_an_error(header):
    assert TraceContext.from_traceparent(header) is None


def test_a_future_version_s_traceparent_keeps_its_first_four_fields():
    assert TraceContext.from_traceparent("01" + HEADER[2:] + "-more") == TraceContext.from_traceparent(HEADER)


@pytest.mark.parametrize("raw, why", [
    (b"", "0 bytes"), (bytes(26), "26 bytes"),
    (bytes(16) + bytes([1]) * 9, "trace_id"), (bytes([1]) * 16 + bytes(8) + b"\x01", "parent_span_id"),
])
def test_a_bad_wire_form_is_a_protocol_error_naming_the_peer(raw, why):
    with pytest.raises(ProtocolError, match=why) as err:
        TraceContext.from_bytes(raw, "10.1.2.3:4")
    assert "10.1.2.3:4" in str(err.value)


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8), st.integers(0, 255))
def test_every_valid_context_round_trips(trace_id, span_id, flags):
    if not any(trace_id) or not any(span_id):
        return
    tc = TraceContext(trace_id, span_id, flags)
    assert TraceContext.from_bytes(tc.to_bytes()) == tc == TraceContext.from_traceparent(tc.to_traceparent())


def test_transport_frame_types_come_back_typed():
    ftype, meta_len, payload_len = parse_frame_header(pack_frame(FrameType.MSG, b"abc", 5)[:FRAME_HDR.size], "p")
    assert ftype is FrameType.MSG and (meta_len, payload_len) == (3, 5)
