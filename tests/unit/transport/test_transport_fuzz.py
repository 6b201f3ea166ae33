# SPDX-License-Identifier: Apache-2.0
"""Hypothesis fuzzing of a real tcp KV listener: malformed and unauthenticated frames, and
malformed frames from an authenticated peer. After every example the listener must still serve
a good client end to end."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_disagg.transport import BlockWrite, TransportOptions, get_transport
from vllm_disagg.transport.kv_common import pack_hello
from vllm_disagg.transport.wire import (
    FRAME_HDR,
    KV_WRITE_META,
    MAGIC,
    PROTOCOL_VERSION,
    T_AUTH,
    T_KV_WRITE,
    SockStream,
    client_handshake,
    connect_socket,
    frame_head,
)

pytestmark = pytest.mark.timeout(300)
TOKEN = "fuzz-token"
NUM_BLOCKS, BLOCK_ELEMS = 8, 256


@pytest.fixture(scope="module")
def served():
    tr = get_transport("tcp", TransportOptions(auth_token=TOKEN, timeout_s=5.0))
    rx = tr.kv_receiver(name="fuzzed")
    cache = torch.zeros(NUM_BLOCKS, BLOCK_ELEMS)
    rx.register_region("layer.0", cache)
    rx.start()
    yield tr, rx, cache
    rx.close()


def _frame(ftype: int, meta: bytes, payload_len: int, magic=MAGIC, version=PROTOCOL_VERSION) -> bytes:
    return frame_head(ftype, meta, payload_len, magic=magic, version=version) + meta  # a valid header CRC


frames = st.one_of(
    st.binary(min_size=0, max_size=200),  # raw garbage
    st.builds(  # frame-shaped junk with random header fields
        _frame,
        st.integers(0, 40),
        st.binary(max_size=96),
        st.integers(0, 1 << 40),
        st.sampled_from([MAGIC, b"VDTX", b"\0\0\0\0"]),
        st.sampled_from([PROTOCOL_VERSION, 0, 1, 65535]),
    ),
    st.builds(
        lambda mac: _frame(T_AUTH, os.urandom(32) + mac + pack_hello(b"s" * 16, 0, "x"), 0),
        st.binary(min_size=32, max_size=32),
    ),  # AUTH with a forged MAC
)

# KV_WRITE from an authenticated peer with fields out of bounds.
bad_writes = st.builds(
    lambda seq, chunk, num_chunks, region, ids, tid_len, extra: _frame(
        T_KV_WRITE,
        KV_WRITE_META.pack(seq, chunk, num_chunks, 0, region, len(ids), tid_len)
        + b"t" * min(tid_len, 300)
        + struct.pack(f"<{len(ids)}I", *ids),
        max(0, len(ids) * BLOCK_ELEMS * 4 + extra),
    ),
    st.integers(0, 1 << 62),
    st.integers(0, 5),
    st.integers(0, 5),
    st.integers(0, 3),
    st.lists(st.integers(0, 2**32 - 1), max_size=6),
    st.integers(0, 400),
    st.sampled_from([0, 0, 1, -1]),
)


def _good_client_still_served(tr, rx, cache) -> None:
    tx = tr.kv_sender(name="good")
    peer = tx.connect(rx.address, timeout=5)
    src = torch.randn(NUM_BLOCKS, BLOCK_ELEMS)
    peer.write_blocks([BlockWrite("layer.0", src, [3], [6])], "good", 0).wait(5)
    n = rx.wait_notification(timeout=5)
    while n.peer != "good":
        n = rx.wait_notification(timeout=5)
    assert n.transfer_id == "good" and torch.equal(cache[6], src[3])
    tx.close()


def _send_as_an_authenticated_peer(rx, data: bytes, name: str) -> None:
    """Authenticate, send `data`, and read until the server closes (or resets) the connection."""
    stream = SockStream(connect_socket(rx.address, 5), rx.address, 5)
    client_handshake(stream, TOKEN.encode(), b"kv", pack_hello(os.urandom(16), 0, name))
    try:
        stream.sock.sendall(data)
        stream.sock.shutdown(socket.SHUT_WR)
        while stream.sock.recv(4096):
            pass
    except OSError:
        pass
    finally:
        stream.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=frames)
def test_unauthenticated_garbage_is_rejected_and_the_listener_keeps_serving(served, data):
    tr, rx, cache = served
    host, port = rx.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.recv(FRAME_HDR.size + 32)  # CHALLENGE
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
        except OSError:
            pass  # the server may reset us; that is a valid rejection
    _good_client_still_served(tr, rx, cache)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=bad_writes)
def test_malformed_frames_from_an_authenticated_peer_are_dropped_without_touching_memory(served, data):
    tr, rx, cache = served
    before = cache.clone()
    _send_as_an_authenticated_peer(rx, data, "fuzzer")
    # No payload bytes are ever sent, so whatever the server made of the frame, memory is untouched.
    assert torch.equal(cache, before)
    _good_client_still_served(tr, rx, cache)


def test_a_kv_write_whose_destination_changed_on_the_way_is_refused_before_any_block_is_touched(served):
    """A byte flipped in a KV_WRITE's meta (here its destination block id, 6 -> 7) would land the
    block in another request's KV; KV verification checks the payload only. Transport v2's header CRC
    refuses the frame, the connection is dropped, and the cache is untouched."""
    tr, rx, cache = served
    before = cache.clone()
    meta = KV_WRITE_META.pack(0, 0, 1, 0, 0, 1, 1) + b"t" + struct.pack("<I", 6)
    frame = bytearray(_frame(T_KV_WRITE, meta, BLOCK_ELEMS * 4))
    frame[-4] ^= 0x01  # block 6 -> 7, after the CRC was computed
    num_rejected = rx.stats.num_rejected_frames
    _send_as_an_authenticated_peer(rx, bytes(frame) + torch.ones(BLOCK_ELEMS).numpy().tobytes(), "flipper")
    deadline = time.monotonic() + 5
    while rx.stats.num_rejected_frames == num_rejected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats.num_rejected_frames > num_rejected
    assert torch.equal(cache, before)
    _good_client_still_served(tr, rx, cache)
