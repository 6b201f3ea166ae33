# SPDX-License-Identifier: Apache-2.0
"""Attention wire v4: typed message types, the W3C trace context on the frames that start a step
(INIT, step metadata), every frame still checked, and an older peer refused naming both versions."""

from __future__ import annotations

import struct

import pytest
import torch
from retain_helpers import BS, GEOM, TOKEN, _step

from vllm_disagg.attention import wire
from vllm_disagg.attention.client import DisaggAttentionClient
from vllm_disagg.attention.server import DisaggAttentionServer, _Session
from vllm_disagg.errors import ProtocolError
from vllm_disagg.observe.context import TraceContext
from vllm_disagg.transport import Message

TRACE = TraceContext(bytes(range(1, 17)), bytes(range(1, 9)), 1)


class _Recorder:
    """Stands in for a channel: keeps what the server answers."""

    def __init__(self) -> None:
        self.replies: list[wire.Header] = []
        self.texts: list[str] = []

    def send(self, header, tensors, timeout=None) -> None:
        self.replies.append(wire.unpack_header(header))
        self.texts.append(bytes(tensors[0]).decode() if tensors and self.replies[-1].mtype is wire.ERROR else "")


@pytest.fixture(scope="module")
def server():
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=8 << 20, auth_token=TOKEN)
    srv.start()
    yield srv
    srv.stop()


def _frame(h: wire.Header, payloads) -> Message:
    views = [wire.byte_view(p) if isinstance(p, torch.Tensor) else memoryview(p) for p in payloads]
    return Message(h.pack(), views)


def test_message_types_are_an_enum_and_headers_come_back_typed():
    h = wire.unpack_header(wire.Header(wire.CLAIM_OK, seq=3).pack())
    assert h.mtype is wire.MsgType.CLAIM_OK and h.mtype.name == "CLAIM_OK" and h.seq == 3
    assert [int(t) for t in wire.MsgType] == list(range(1, 15))  # the numbers on the wire did not move


def test_an_older_peer_is_refused_with_one_line_naming_both_versions():
    old = bytearray(wire.Header(wire.PING, seq=1).pack())
    struct.pack_into("<H", old, 4, 3)
    with pytest.raises(ProtocolError, match=f"version 3 from the peer, this side speaks {wire.PROTOCOL_VERSION}"):
        wire.unpack_header(bytes(old))
    with pytest.raises(ProtocolError, match="unknown flags 0x40"):
        wire.unpack_header(wire.Header(wire.PING, flags=0x40).pack())


def test_the_server_keeps_the_trace_of_the_step_it_serves_and_checks_it(server):
    session, ch = _Session(), _Recorder()
    init = wire.Header(wire.INIT, seq=1, flags=wire.HAS_TRACE)
    server._handle(ch, session, _frame(init, [wire.Geometry(**GEOM).to_json(), TRACE.to_bytes()]))
    assert ch.replies[-1].mtype is wire.INIT_OK and session.trace == TRACE
    meta = _step([1], 0, 8)
    q, k, v = torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    other = TraceContext(bytes([9]) * 16, bytes([7]) * 8, 0)
    head = dict(layer=0, meta_id=77, num_tokens=8, num_reqs=1, num_cols=1, scale=0.1)
    step = wire.Header(wire.ATTN, seq=2, flags=wire.HAS_META | wire.HAS_TRACE, **head)
    server._handle(ch, session, _frame(step, [q, k, v, *meta.step.tensors(), other.to_bytes()]))
    assert ch.replies[-1].mtype is wire.OUT and session.trace == other
    untraced = wire.Header(wire.ATTN, seq=3, flags=wire.HAS_META, **{**head, "meta_id": 78})
    server._handle(ch, session, _frame(untraced, [q, k, v, *meta.step.tensors()]))
    assert ch.replies[-1].mtype is wire.OUT and session.trace is None  # a step without one clears it
    bad = {
        "trace on a frame that starts no step": (wire.Header(wire.PING, seq=4, flags=wire.HAS_TRACE),
                                                 [TRACE.to_bytes()]),
        "trace of the wrong size": (wire.Header(wire.ATTN, seq=5, flags=wire.HAS_META | wire.HAS_TRACE,
                                                **{**head, "meta_id": 79}),
                                    [q, k, v, *meta.step.tensors(), TRACE.to_bytes()[:24]]),
        "all-zero trace id": (wire.Header(wire.INIT, seq=6, flags=wire.HAS_TRACE),
                              [wire.Geometry(**GEOM).to_json(), bytes(16) + bytes(range(1, 10))]),
    }
    for payload_h, payloads in bad.values():
        server._handle(ch, session, _frame(payload_h, payloads))
        assert ch.replies[-1].mtype is wire.ERROR and ch.replies[-1].seq == payload_h.seq
    assert "travels only on INIT or step metadata" in ch.texts[-3] and "must be 25 bytes" in ch.texts[-2]


def test_a_client_sends_the_trace_with_init_and_with_each_step_s_metadata(server, monkeypatch):
    seen = []
    dispatch = server._dispatch

    def record(session, h, bufs):
        seen.append((h.mtype, session.trace))
        return dispatch(session, h, bufs)

    monkeypatch.setattr(server, "_dispatch", record)
    client = DisaggAttentionClient([server.info()["http"]], transport="tcp", send_q_early=False, auth_token=TOKEN)
    client.connect(**GEOM, trace=TRACE)
    meta = _step([2], 0, BS)
    meta.trace = TraceContext(bytes([5]) * 16, bytes([6]) * 8, 1)
    out = torch.empty(BS, 4, 32)
    for layer in range(GEOM["num_layers"]):
        client.attend(layer, torch.randn(BS, 4, 32), torch.randn(BS, 2, 32), torch.randn(BS, 2, 32), meta, 0.2, out)
    client.close()
    assert seen == [(wire.INIT, TRACE), (wire.ATTN, meta.trace), (wire.ATTN, meta.trace)]


@pytest.mark.parametrize("field, value", [("max_num_tokens", 1 << 21), ("num_layers", 5000), ("head_size", 8192)])
def test_a_geometry_no_model_has_is_refused_before_anything_is_allocated(field, value):
    with pytest.raises(ProtocolError, match=field):
        wire.Geometry(**{**GEOM, field: value})
    with pytest.raises(ProtocolError, match="output buffer"):
        wire.Geometry(**{**GEOM, "max_num_tokens": 1 << 20, "num_heads": 1024, "num_kv_heads": 1024,
                         "head_size": 2048})
