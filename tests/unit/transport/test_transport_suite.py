# SPDX-License-Identifier: Apache-2.0
"""The one transport suite, run over tcp, shm and nixl with real processes and sockets.

KV cases: the parent owns a `KVReceiver` (like a decode worker); a spawn child is the sender
(like a prefill worker), writing deterministic data the parent regenerates to check bit-exactness.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from vllm_disagg.errors import AuthError, DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.testing.peers import (
    kv_receiver_child,
    kv_sender_child,
    layer_data,
    msg_echo_child,
    wait_for,
)
from vllm_disagg.transport import BlockWrite, TransportOptions, XferState, get_transport
from vllm_disagg.transport.wire import FRAME_HDR, T_ERROR, parse_address

pytestmark = pytest.mark.timeout(120)

TOKEN = "suite-token"  # same as conftest.options

NUM_BLOCKS = 64
BLOCK_ELEMS = 4 * 16 * 32  # 8 KiB float32 blocks, KV-like [heads, block_size, head_dim]


def _receiver(transport, num_layers=4, num_blocks=NUM_BLOCKS):
    rx = transport.kv_receiver(name="decode-0")
    caches = [torch.zeros(num_blocks, BLOCK_ELEMS) for _ in range(num_layers)]
    for i, t in enumerate(caches):
        rx.register_region(f"layer.{i}", t)
    rx.start()
    return rx, caches


def _connected_sender(spawn, kind, address, options=None):
    child = spawn(kv_sender_child, kind, TOKEN, options or {"chunk_bytes": 64 << 10, "num_streams": 3})
    child.conn.send(("connect", address))
    wait_for(child.conn, "ok")
    return child


def _write(region, layer, src_ids, dst_ids, tid, nsrc=NUM_BLOCKS):
    return (region, layer, nsrc, BLOCK_ELEMS, list(src_ids), list(dst_ids), tid)


def test_bulk_writes_land_bit_exact_with_one_notification_per_layer(transport, kind, spawn):
    rx, caches = _receiver(transport)
    child = _connected_sender(spawn, kind, rx.address)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()
    plan = [_write(f"layer.{i}", i, range(NUM_BLOCKS), perm, "req-bulk") for i in range(4)]
    child.conn.send(("write", 7, plan))
    assert wait_for(child.conn, "done")[1] == ["done"] * 4
    notifs = [rx.wait_notification(timeout=20) for _ in range(4)]
    assert [(n.transfer_id, n.layer, n.seq) for n in notifs] == [("req-bulk", i, i) for i in range(4)]
    assert all(n.nbytes == NUM_BLOCKS * BLOCK_ELEMS * 4 for n in notifs)
    for i, cache in enumerate(caches):
        assert torch.equal(cache[perm], layer_data(7, i, NUM_BLOCKS, BLOCK_ELEMS))
    rx.close()


def test_many_small_writes_arrive_complete_and_in_issue_order(transport, kind, spawn):
    rx, caches = _receiver(transport, num_layers=1, num_blocks=256)
    child = _connected_sender(spawn, kind, rx.address)
    plan = [_write("layer.0", 0, [i % NUM_BLOCKS], [i], f"r{i}") for i in range(256)]
    child.conn.send(("write", 3, plan))
    assert set(wait_for(child.conn, "done")[1]) == {"done"}
    notifs = [rx.wait_notification(timeout=20) for _ in range(256)]
    assert [n.seq for n in notifs] == list(range(256))
    assert [n.transfer_id for n in notifs] == [f"r{i}" for i in range(256)]
    src = layer_data(3, 0, NUM_BLOCKS, BLOCK_ELEMS)
    assert torch.equal(caches[0], src[[i % NUM_BLOCKS for i in range(256)]])
    rx.close()


def test_a_sender_that_closes_as_soon_as_its_writes_are_done_loses_no_notification(transport, kind, spawn):
    """The goodbye may overtake the last notifications (nixl: they travel apart from the control
    socket); the receiver still delivers every one, and does not call a clean goodbye a loss."""
    rx, caches = _receiver(transport, num_layers=3)
    child = _connected_sender(spawn, kind, rx.address)
    plan = [_write(f"layer.{i}", i, range(NUM_BLOCKS), range(NUM_BLOCKS), "bulk") for i in range(3)]
    plan += [_write("layer.1", 1, [k], [k], f"tail{k}") for k in range(32)]  # same bytes again
    plan.append(_write("layer.2", 2, [], [], "empty"))  # a notification without data
    child.conn.send(("write", 5, plan))
    child.conn.send(("exit",))  # queued: the child closes the moment its handles are DONE
    assert wait_for(child.conn, "done")[1] == ["done"] * len(plan)
    wait_for(child.conn, "bye")
    notifs = [rx.wait_notification(timeout=20) for _ in plan]
    assert [(n.transfer_id, n.layer, n.seq) for n in notifs] == [(w[-1], w[1], i) for i, w in enumerate(plan)]
    for i, cache in enumerate(caches):
        assert torch.equal(cache, layer_data(5, i, NUM_BLOCKS, BLOCK_ELEMS))
    assert rx.lost_peers() == [] and rx.stats.num_rejected_frames == 0
    rx.close()


def test_each_notification_arrives_only_after_its_data_has_landed(transport, kind, spawn):
    rx, caches = _receiver(transport, num_layers=2)
    child = _connected_sender(spawn, kind, rx.address)
    # Alternate big multi-chunk writes and one-block writes over disjoint destination blocks.
    plan, expected = [], []
    for k in range(8):
        layer = k % 2
        dst = list(range(k * 8, k * 8 + (7 if k % 2 == 0 else 1)))
        plan.append(_write(f"layer.{layer}", layer, dst, dst, f"w{k}"))
        expected.append((layer, dst))
    child.conn.send(("write", 11, plan))
    src = [layer_data(11, i, NUM_BLOCKS, BLOCK_ELEMS) for i in range(2)]
    for k, (layer, dst) in enumerate(expected):
        n = rx.wait_notification(timeout=20)
        assert (n.transfer_id, n.seq) == (f"w{k}", k)
        assert torch.equal(caches[layer][dst], src[layer][dst]), (
            f"data of write {k} not there at its notification"
        )
    wait_for(child.conn, "done")
    rx.close()


def test_a_killed_sender_is_reported_lost_and_the_receiver_keeps_serving(transport, kind, spawn):
    rx, caches = _receiver(transport, num_layers=1)
    child = _connected_sender(spawn, kind, rx.address)
    child.conn.send(("stream", 5, [_write("layer.0", 0, range(32), range(32), "forever")]))
    rx.wait_notification(timeout=20)
    child.kill()
    deadline = time.monotonic() + 15
    lost: list[str] = []
    while not lost and time.monotonic() < deadline:
        lost = rx.lost_peers()
        time.sleep(0.05)
    assert lost and lost[0].startswith("child-")
    # A new sender is served normally afterwards.
    tx = transport.kv_sender(name="second")
    peer = tx.connect(rx.address, timeout=10)
    rx.poll_notifications()
    src = layer_data(9, 0, NUM_BLOCKS, BLOCK_ELEMS)
    peer.write_blocks([BlockWrite("layer.0", src, [1, 2], [40, 41])], "after", 0).wait(10)
    n = rx.wait_notification(timeout=10)
    while n.peer != "second":
        n = rx.wait_notification(timeout=10)
    assert n.transfer_id == "after" and torch.equal(caches[0][40:42], src[1:3])
    tx.close()
    rx.close()


def test_a_killed_receiver_fails_pending_writes_with_peer_lost_not_a_hang(transport, kind, spawn):
    child = spawn(kv_receiver_child, kind, TOKEN, 1, NUM_BLOCKS, BLOCK_ELEMS)
    address = wait_for(child.conn, "addr")[1]
    tx = transport.kv_sender(name="prefill-0")
    peer = tx.connect(address, timeout=10)
    src = layer_data(1, 0, NUM_BLOCKS, BLOCK_ELEMS)
    peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "before", 0).wait(10)
    child.kill()
    t0 = time.monotonic()
    state = XferState.PENDING
    while state is not XferState.FAILED and time.monotonic() - t0 < 15:
        h = peer.write_blocks([BlockWrite("layer.0", src, range(NUM_BLOCKS), range(NUM_BLOCKS))], "after", 0)
        try:
            h.wait(12)
        except DisaggError:
            pass
        state = h.state()
    assert state is XferState.FAILED and isinstance(h.error, PeerLostError | TransportTimeout)
    assert time.monotonic() - t0 < 15
    tx.close()


def test_a_killed_message_peer_surfaces_as_peer_lost_on_recv(transport, kind, spawn):
    child = spawn(msg_echo_child, kind, TOKEN)
    ch = transport.connect_msg(wait_for(child.conn, "addr")[1], timeout=10)
    ch.send(b"ping", [torch.arange(8.0)])
    m = ch.recv(timeout=10)
    assert m.header == b"ping" and torch.equal(
        torch.frombuffer(m.buffers[0], dtype=torch.float32), torch.arange(8.0)
    )
    child.kill()
    t0 = time.monotonic()
    with pytest.raises(PeerLostError):
        for _ in range(3):  # a send may still be buffered by the kernel; the recv must fail
            ch.send(b"ping", [torch.arange(8.0)])
            ch.recv(timeout=8)
    assert time.monotonic() - t0 < 10
    ch.close()


def test_messages_land_in_preallocated_buffers_and_too_small_ones_are_refused(transport, kind, spawn):
    child = spawn(msg_echo_child, kind, TOKEN)
    ch = transport.connect_msg(wait_for(child.conn, "addr")[1], timeout=10)
    q, kv = torch.randn(4, 64), torch.randn(2, 4, 64).to(torch.bfloat16)
    out_q, out_kv = torch.empty(16, 64), torch.empty(4, 4, 64, dtype=torch.bfloat16)
    ch.send(b"layer-3", [q, kv])
    m = ch.recv(out=[out_q, out_kv], timeout=10)
    assert m.header == b"layer-3" and m.lengths == [q.numel() * 4, kv.numel() * 2]
    assert torch.equal(out_q[:4], q) and torch.equal(out_kv[:2], kv)
    ch.send(b"big", [torch.randn(64, 64)])
    with pytest.raises(ValueError, match="too small"):
        ch.recv(out=[torch.empty(8)], timeout=10)
    ch.send(b"again", [q])
    assert ch.recv(out=[out_q], timeout=10).header == b"again"  # the channel is still usable
    ch.close()


def test_garbage_on_the_listener_is_rejected_and_a_good_peer_is_still_served(transport, kind, spawn):
    rx, caches = _receiver(transport, num_layers=1)
    family, addr = parse_address(_control_address(kind, rx))
    for garbage in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"VDTP" + b"\xff" * 40,
        FRAME_HDR.pack(b"VDTP", 2, 2, 1 << 30, 0, 0),
    ]:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(addr)
            s.recv(FRAME_HDR.size + 32)  # CHALLENGE
            s.sendall(garbage)
            reply = _read_all(s)
            assert reply == b"" or FRAME_HDR.unpack_from(reply)[2] == T_ERROR
    assert rx.stats.num_rejected_frames >= 3
    child = _connected_sender(spawn, kind, rx.address)
    child.conn.send(("write", 2, [_write("layer.0", 0, [0], [5], "good")]))
    assert rx.wait_notification(timeout=20).transfer_id == "good"
    rx.close()


def test_a_wrong_token_fails_authentication_on_both_apis(transport, kind, options):
    rx, _ = _receiver(transport, num_layers=1)
    listener = transport.listen_msg()
    bad = get_transport(kind, TransportOptions(auth_token="wrong", timeout_s=5))
    intruder = bad.kv_sender(name="intruder")
    with pytest.raises(AuthError):
        intruder.connect(rx.address, timeout=5)
    intruder.close()
    with pytest.raises((AuthError, ProtocolError)):
        bad.connect_msg(listener.address, timeout=5)
    assert rx.stats.num_rejected_frames >= 1
    good = transport.connect_msg(listener.address, timeout=10)
    server_side = listener.accept(timeout=10)
    good.close()
    server_side.close()
    listener.close()
    rx.close()


def test_caller_mistakes_raise_value_error_at_the_call(transport, kind):
    rx, _ = _receiver(transport, num_layers=1)
    tx = transport.kv_sender(name="p")
    peer = tx.connect(rx.address, timeout=10)
    src = torch.zeros(NUM_BLOCKS, BLOCK_ELEMS)
    with pytest.raises(ValueError, match="unknown region"):
        peer.write_blocks([BlockWrite("nope", src, [0], [0])], "t", 0)
    with pytest.raises(ValueError, match="out of range"):
        peer.write_blocks([BlockWrite("layer.0", src, [0], [NUM_BLOCKS])], "t", 0)
    with pytest.raises(ValueError):
        peer.write_blocks([BlockWrite("layer.0", torch.zeros(4, 7), [0], [0])], "t", 0)
    tx.close()
    rx.close()


def _control_address(kind: str, rx) -> str:
    return rx.address  # tcp/nixl: host:port, shm: @name; all start with the HMAC challenge


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def test_every_wait_is_bounded_by_its_timeout_when_the_peer_is_alive_but_silent(transport, kind):
    rx, _ = _receiver(transport, num_layers=1)
    listener = transport.listen_msg()
    client = transport.connect_msg(listener.address, timeout=10)
    server = listener.accept(timeout=10)
    for wait in (lambda: rx.wait_notification(timeout=0.3), lambda: server.recv(timeout=0.3)):
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            wait()
        assert time.monotonic() - t0 < 5
    with pytest.raises(TransportTimeout):
        listener.accept(timeout=0.2)
    client.close()
    server.close()
    listener.close()
    rx.close()
