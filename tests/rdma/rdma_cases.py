# SPDX-License-Identifier: Apache-2.0
"""The `rdma` backend's transport cases, runnable without pytest, torch or numpy.

Why a plain script: it must run inside the soft-RoCE VM (Debian python3.11 + python3-pyverbs
only, see `run_softroce_vm.sh`). It prints one `RDMA-CASE PASS|FAIL <name> <seconds>` line per
case and `RDMA-SUITE DONE rc=<failures>` last; the host test parses those lines. On a machine
with a native ibverbs device, `tests/unit/transport/test_rdma_native.py` runs the same CASES
under pytest. Buffers are anonymous mmaps viewed as `[num_blocks, block_bytes]` memoryviews.

    python3 tests/rdma/rdma_cases.py [case-name ...]
"""

from __future__ import annotations

import mmap
import os
import random
import subprocess
import sys
import threading
import time
import traceback

if __package__ in (None, ""):  # run as a script: make `vllm_disagg` importable from the repo
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from vllm_disagg.errors import AuthError, PeerLostError, TransportTimeout  # noqa: E402
from vllm_disagg.transport import BlockWrite, TransportOptions, XferState, get_transport  # noqa: E402

TOKEN = "softroce-test-token"
BLOCK = 16 << 10


def blocks(num_blocks: int, block_bytes: int = BLOCK, seed: int | None = None) -> memoryview:
    """A `[num_blocks, block_bytes]` byte view over fresh anonymous memory (random if seeded)."""
    buf = mmap.mmap(-1, num_blocks * block_bytes)
    if seed is not None:
        buf[:] = random.Random(seed).randbytes(num_blocks * block_bytes)
    return memoryview(buf).cast("B", (num_blocks, block_bytes))


def block_bytes(view: memoryview, i: int) -> bytes:
    bs = view.shape[1]
    return view.cast("B")[i * bs : (i + 1) * bs].tobytes()


def transport(**over):
    # 128 KiB message slots: the 4 MiB default pins 64 MiB of rings per channel, slow under TCG.
    over.setdefault("chunk_bytes", 128 << 10)
    return get_transport(
        "rdma",
        TransportOptions(auth_token=over.pop("token", TOKEN), timeout_s=over.pop("timeout_s", 20.0), **over),
    )


class Pair:
    """A receiver with `layers` regions and a connected sender peer, in this process."""

    def __init__(
        self, layers: int = 2, num_blocks: int = 32, block_bytes: int = BLOCK, completion=None, **over
    ):
        self.tr = transport(**over)
        self.rx = self.tr.kv_receiver(name="rx")
        self.caches = [blocks(num_blocks, block_bytes) for _ in range(layers)]
        for i, c in enumerate(self.caches):
            self.rx.register_region(f"layer.{i}", c)
        self.addr = self.rx.start()
        self.tx = self.tr.kv_sender(name="tx", completion=completion)
        self.peer = self.tx.connect(self.addr, timeout=10)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def log(msg: str) -> None:
    print(f"  [{time.monotonic() - _T0:7.2f}s] {msg}", flush=True)


_T0 = time.monotonic()


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def expect_raises(exc, fn, what: str):
    try:
        fn()
    except exc as err:
        return err
    raise AssertionError(f"{what}: {exc.__name__} not raised")


# ---- cases --------------------------------------------------------------------------------------
def case_bulk_write_lands_bit_exact(completion: str = "seqword") -> None:
    p = Pair(layers=2, num_blocks=48, completion=completion)
    try:
        expect(sorted(p.peer.regions) == ["layer.0", "layer.1"], f"regions {p.peer.regions}")
        src = [blocks(40, seed=10 + i) for i in range(2)]
        src_ids = [0, 1, 2, 3, 10, 11, 30, 5, 6, 7, 39]
        dst_ids = [47, 46, 45, 44, 0, 1, 20, 21, 22, 23, 8]  # descending, runs, and scattered ids
        writes = [BlockWrite(f"layer.{i}", src[i], src_ids, dst_ids) for i in range(2)]
        h = p.peer.write_blocks(writes, "req-bulk", layer=-1)
        h.wait(20)
        expect(h.state() is XferState.DONE, f"handle {h.state()}")
        n = p.rx.wait_notification(10)
        expect((n.peer, n.transfer_id, n.layer, n.seq) == ("tx", "req-bulk", -1, 0), f"notification {n}")
        expect(n.nbytes == 2 * len(src_ids) * BLOCK, f"nbytes {n.nbytes}")
        for i in range(2):
            for s, d in zip(src_ids, dst_ids):
                expect(
                    block_bytes(p.caches[i], d) == block_bytes(src[i], s), f"layer {i} block {s}->{d} differs"
                )
            untouched = set(range(48)) - set(dst_ids)
            expect(
                all(block_bytes(p.caches[i], d) == bytes(BLOCK) for d in untouched),
                "a block not written changed",
            )
        # A 2 MiB write in one run, and one with more runs than a single post chain carries.
        big = blocks(128, seed=3)
        h1 = p.peer.write_blocks(
            [BlockWrite("layer.0", big, list(range(0, 128, 4))[:32], list(range(32)))], "req-scatter", 0
        )
        h1.wait(20)
        n1 = p.rx.wait_notification(10)
        expect((n1.transfer_id, n1.seq) == ("req-scatter", 1), f"notification {n1}")
        expect(
            all(block_bytes(p.caches[0], d) == block_bytes(big, 4 * d) for d in range(32)),
            "scattered blocks differ",
        )
    finally:
        p.close()


def case_many_small_writes_keep_seq_order(completion: str = "seqword") -> None:
    # 300 notifications through a 64-slot ring: credits must flow back, order must hold (imm mode:
    # receives must be reposted before credits return, or the sender meets an empty receive queue).
    p = Pair(layers=1, num_blocks=64, block_bytes=1024, completion=completion)
    try:
        src = blocks(64, 1024, seed=7)
        handles = [
            p.peer.write_blocks([BlockWrite("layer.0", src, [i % 64], [(i * 7) % 64])], f"t{i}", i % 5)
            for i in range(300)
        ]
        for h in handles:
            h.wait(30)
        got = []
        while len(got) < 300:
            got.append(p.rx.wait_notification(10))
        expect([n.seq for n in got] == list(range(300)), "notifications out of seq order")
        expect([n.transfer_id for n in got] == [f"t{i}" for i in range(300)], "transfer ids out of order")
        expect([n.layer for n in got] == [i % 5 for i in range(300)], "layers wrong")
        expect(
            all(block_bytes(p.caches[0], (i * 7) % 64) == block_bytes(src, i % 64) for i in range(236, 300)),
            "data differs",
        )
        expect(p.rx.poll_notifications() == [], "extra notifications")
    finally:
        p.close()


def case_caller_mistakes_raise_at_the_call() -> None:
    p = Pair(layers=1, num_blocks=8)
    try:
        src = blocks(8, seed=1)
        expect_raises(
            ValueError,
            lambda: p.peer.write_blocks([BlockWrite("nope", src, [0], [0])], "x"),
            "unknown region",
        )
        expect_raises(
            ValueError,
            lambda: p.peer.write_blocks([BlockWrite("layer.0", src, [0], [8])], "x"),
            "dst out of range",
        )
        expect_raises(
            ValueError,
            lambda: p.peer.write_blocks([BlockWrite("layer.0", src, [9], [0])], "x"),
            "src out of range",
        )
        expect_raises(
            ValueError,
            lambda: p.peer.write_blocks([BlockWrite("layer.0", src, [0, 1], [0])], "x"),
            "id count",
        )
        small = blocks(8, 512, seed=2)
        expect_raises(
            ValueError,
            lambda: p.peer.write_blocks([BlockWrite("layer.0", small, [0], [0])], "x"),
            "block size",
        )
        expect_raises(
            ValueError,
            lambda: p.peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "t" * 200),
            "long tid",
        )
        h = p.peer.write_blocks([BlockWrite("layer.0", src, [3], [4])], "ok", 0)
        h.wait(20)  # the peer is still usable after the rejected calls
        expect(p.rx.wait_notification(10).seq == 0, "seq must not advance on rejected calls")
    finally:
        p.close()


def case_bad_token_is_rejected_and_server_keeps_serving() -> None:
    p = Pair(layers=1, num_blocks=4)
    try:
        log("pair up")
        bad = transport(token="wrong-token").kv_sender(name="intruder")
        expect_raises(AuthError, lambda: bad.connect(p.addr, timeout=10), "wrong token")
        bad.close()
        log("intruder rejected")
        src = blocks(4, seed=5)
        p.peer.write_blocks([BlockWrite("layer.0", src, [1], [2])], "after-bad", 0).wait(20)
        n = p.rx.wait_notification(10)
        expect(
            n.transfer_id == "after-bad" and block_bytes(p.caches[0], 2) == block_bytes(src, 1),
            "server stopped serving",
        )
        expect(p.rx.stats.snapshot()["num_rejected_frames"] >= 1, "rejection not counted")
    finally:
        p.close()


def case_qp_error_fails_the_handle_cleanly(completion: str = "seqword") -> None:
    # The receiver invalidates the region's rkey mid-stream: the NIC NAKs the WRITE, the sender's
    # QP goes to ERR and the handle must fail with a clear error (never hang, never raise).
    p = Pair(layers=1, num_blocks=4, timeout_s=15.0, completion=completion)
    try:
        src = blocks(4, seed=9)
        p.peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "before", 0).wait(20)
        p.rx._regions[0].mr.close()  # deregister: the rkey the sender holds is now invalid
        t0 = time.monotonic()
        h = p.peer.write_blocks([BlockWrite("layer.0", src, [1], [1])], "during", 0)
        err = expect_raises(PeerLostError, lambda: h.wait(30), "write with a revoked rkey")
        expect(
            h.state() is XferState.FAILED and "REM_ACCESS_ERR" in str(err), f"state {h.state()} error {err!r}"
        )
        log(f"remote access error surfaced after {time.monotonic() - t0:.2f}s: {err}")
        h2 = p.peer.write_blocks([BlockWrite("layer.0", src, [2], [2])], "after", 0)
        expect_raises(PeerLostError, lambda: h2.wait(5), "later writes on a broken peer")
    finally:
        p.close()
    # A local QP fault (forced to ERR under queued work) flushes and fails the handle too.
    p = Pair(layers=1, num_blocks=4, timeout_s=15.0, completion=completion)
    try:
        src = blocks(4, seed=9)
        p.peer._ep.to_error()
        h = p.peer.write_blocks([BlockWrite("layer.0", src, [1], [1])], "flushed", 0)
        err = expect_raises(PeerLostError, lambda: h.wait(30), "write on an errored QP")
        expect("WR_FLUSH_ERR" in str(err) or "post send" in str(err), f"error names the cause: {err!r}")
        log(f"local QP fault surfaced as: {err}")
    finally:
        p.close()


def case_imm_bulk_write_lands_bit_exact() -> None:
    case_bulk_write_lands_bit_exact("imm")


def case_imm_many_small_writes_keep_seq_order() -> None:
    case_many_small_writes_keep_seq_order("imm")


def case_imm_qp_error_fails_the_handle_cleanly() -> None:
    case_qp_error_fails_the_handle_cleanly("imm")


def case_imm_and_seqword_senders_share_one_receiver() -> None:
    # The receiver serves both completion kinds at once (per-peer flag); each peer's seqs are its own.
    p = Pair(layers=1, num_blocks=64, block_bytes=1024, completion="seqword")
    tx2 = p.tr.kv_sender(name="tx-imm", completion="imm")
    try:
        peer2 = tx2.connect(p.addr, timeout=10)
        src = blocks(64, 1024, seed=21)
        handles = []
        for i in range(100):
            peer, dst = (p.peer, i % 32) if i % 2 == 0 else (peer2, 32 + i % 32)
            handles.append(peer.write_blocks([BlockWrite("layer.0", src, [i % 64], [dst])], f"m{i}", 0))
        for h in handles:
            h.wait(30)
        got = [p.rx.wait_notification(10) for _ in range(100)]
        for name, parity in (("tx", 0), ("tx-imm", 1)):
            mine = [n for n in got if n.peer == name]
            expect([n.seq for n in mine] == list(range(50)), f"{name}: seqs {[n.seq for n in mine][:8]}...")
            want = [f"m{i}" for i in range(parity, 100, 2)]
            expect([n.transfer_id for n in mine] == want, f"{name}: transfer ids out of order")
        # Block d was last written by the highest i that maps to it: i >= 68 for both senders.
        expect(
            all(block_bytes(p.caches[0], i % 32) == block_bytes(src, i % 64) for i in range(68, 100, 2)),
            "seqword sender's data differs",
        )
        expect(
            all(block_bytes(p.caches[0], 32 + i % 32) == block_bytes(src, i % 64) for i in range(69, 100, 2)),
            "imm sender's data differs",
        )
    finally:
        tx2.close()
        p.close()


def case_sender_death_is_reported_as_lost_peer() -> None:
    p = Pair(layers=1, num_blocks=4)
    try:
        p.peer._stream.sock.close()  # vanish without BYE, like a killed process
        deadline = time.monotonic() + 10
        lost = []
        while not lost and time.monotonic() < deadline:
            lost = p.rx.lost_peers()
            time.sleep(0.05)
        expect(lost == ["tx"], f"lost peers {lost}")
    finally:
        p.close()


def case_receiver_process_death_fails_pending_writes() -> None:
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child-receiver"], stdout=subprocess.PIPE, text=True
    )
    try:
        addr = child.stdout.readline().strip()
        log(f"child receiver up at {addr}")
        expect(addr.startswith("127.0.0.1:"), f"child said {addr!r}")
        tx = transport(timeout_s=15.0).kv_sender(name="tx-child")
        peer = tx.connect(addr, timeout=20)
        src = blocks(4, seed=11)
        peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "alive", 0).wait(20)
        child.kill()
        child.wait(10)
        t0 = time.monotonic()
        h = peer.write_blocks([BlockWrite("layer.0", src, [1], [1])], "dead", 0)
        err = expect_raises(PeerLostError, lambda: h.wait(30), "write to a killed receiver")
        log(f"receiver death surfaced after {time.monotonic() - t0:.2f}s: {err}")
        tx.close()
        log("sender closed")
    finally:
        if child.poll() is None:
            child.kill()


def case_msg_roundtrip_is_bit_exact_and_fragments() -> None:
    tr = transport()
    lst = tr.listen_msg()
    server_err = []

    def echo() -> None:
        try:
            ch = lst.accept(timeout=20)
            for _ in range(3):
                m = ch.recv(timeout=20)
                ch.send(m.header, m.buffers)
            too_small = [memoryview(bytearray(10))]
            expect_raises(ValueError, lambda: ch.recv(out=too_small, timeout=20), "too-small out")
            m = ch.recv(timeout=20)  # still usable after the dropped message
            ch.send(m.header, m.buffers)
        except Exception:
            server_err.append(traceback.format_exc())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    ch = tr.connect_msg(lst.address, timeout=20)
    try:
        rng = random.Random(4)
        for size in (0, 1000, 300 << 10):  # empty, small, and bigger than a 128 KiB slot
            a, b = rng.randbytes(size), rng.randbytes(777)
            ch.send(b"hdr-%d" % size, [a, b])
            outs = [memoryview(bytearray(size + 5)), memoryview(bytearray(800))]
            m = ch.recv(out=outs, timeout=20)
            expect(
                m.header == b"hdr-%d" % size and m.lengths == [size, 777],
                f"echo header {m.header!r} {m.lengths}",
            )
            expect(
                m.buffers[0].tobytes() == a and m.buffers[1].tobytes() == b,
                f"payload of {size} bytes differs",
            )
        ch.send(b"big", [b"x" * 100])
        ch.send(b"next", [b"y" * 3])
        m = ch.recv(timeout=20)
        expect(
            m.header == b"next" and m.buffers[0].tobytes() == b"yyy",
            "channel unusable after a dropped message",
        )
        t.join(10)
        expect(not server_err, "".join(server_err))
    finally:
        ch.close()
        lst.close()


def case_msg_peer_close_raises_peer_lost() -> None:
    tr = transport()
    lst = tr.listen_msg()
    box = []
    t = threading.Thread(target=lambda: box.append(lst.accept(timeout=20)), daemon=True)
    t.start()
    ch = tr.connect_msg(lst.address, timeout=20)
    log("client connected")
    t.join(20)
    log("server accepted")
    try:
        box[0].close()
        log("server side closed")
        t0 = time.monotonic()
        expect_raises(PeerLostError, lambda: ch.recv(timeout=10), "recv from a closed peer")
        expect(time.monotonic() - t0 < 5, "peer loss took too long to notice")
        log(f"peer loss noticed after {time.monotonic() - t0:.2f}s")
        expect_raises(TransportTimeout, lambda: _silent_recv(tr), "bounded recv")
        log("silent recv timed out")
    finally:
        ch.close()
        lst.close()


def _silent_recv(tr) -> None:
    lst = tr.listen_msg()
    box = []
    t = threading.Thread(target=lambda: box.append(lst.accept(timeout=20)), daemon=True)
    t.start()
    ch = tr.connect_msg(lst.address, timeout=20)
    t.join(20)
    log("second channel connected")
    try:
        ch.recv(timeout=0.5)
    finally:
        ch.close()
        box[0].close()
        lst.close()
        log("second channel closed")


def bench(repeats: int = 5, pings: int = 50) -> dict:
    """Functional speed in this environment (TCG VM: emulation speed, not the NIC's)."""
    import json
    import socket
    import statistics

    out = _bench_raw_endpoints(pings)
    p = Pair(layers=1, num_blocks=128, block_bytes=256 << 10)  # 32 MiB region
    try:
        src = blocks(128, 256 << 10, seed=1)
        ids = list(range(128))
        secs = []
        for r in range(repeats):
            t0 = time.perf_counter()
            p.peer.write_blocks([BlockWrite("layer.0", src, ids, ids)], f"bw{r}", 0).wait(120)
            p.rx.wait_notification(60)
            secs.append(time.perf_counter() - t0)
        out["kv_write_32MiB_GBps_median"] = round(32 / 1024 / statistics.median(secs), 4)
        for completion in ("seqword", "imm"):
            out.update(_bench_small_write(completion, pings))
    finally:
        p.close()
    tr = transport()
    lst = tr.listen_msg()
    t = threading.Thread(target=lambda: _echo_n(lst, pings), daemon=True)
    t.start()
    ch = tr.connect_msg(lst.address, timeout=20)
    payload, rtts = random.Random(0).randbytes(16 << 10), []
    buf = [memoryview(bytearray(16 << 10))]
    for _ in range(pings):
        t0 = time.perf_counter()
        ch.send(b"p", [payload])
        ch.recv(out=buf, timeout=30)
        rtts.append(time.perf_counter() - t0)
    t.join(30)
    ch.close()
    lst.close()
    out["rdma_msg_16KiB_rtt_us_p50"] = round(statistics.median(rtts) * 1e6, 1)
    a, b = socket.socketpair()
    rtts = []

    def tcp_echo() -> None:
        for _ in range(pings):
            data = b""
            while len(data) < len(payload):
                data += b.recv(len(payload) - len(data))
            b.sendall(data)

    th = threading.Thread(target=tcp_echo, daemon=True)
    th.start()
    for _ in range(pings):
        t0 = time.perf_counter()
        a.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(a.recv(len(payload) - got))
        rtts.append(time.perf_counter() - t0)
    out["raw_unix_socketpair_16KiB_rtt_us_p50"] = round(statistics.median(rtts) * 1e6, 1)
    print("RDMA-BENCH " + json.dumps(out), flush=True)
    return out


def _bench_small_write(completion: str, pings: int) -> dict:
    """16 KiB write: time to the receiver's notification and to the sender's handle DONE."""
    import statistics

    small = blocks(1, 16 << 10, seed=2)
    lat, done = [], []
    p2 = Pair(layers=1, num_blocks=4, block_bytes=16 << 10, completion=completion)
    try:
        for i in range(pings):
            t0 = time.perf_counter()
            h = p2.peer.write_blocks([BlockWrite("layer.0", small, [0], [i % 4])], f"l{i}", 0)
            p2.rx.wait_notification(30)
            lat.append(time.perf_counter() - t0)
            h.wait(30)
            done.append(time.perf_counter() - t0)
    finally:
        p2.close()
    tag = "" if completion == "seqword" else "_imm"
    return {
        f"kv_write_16KiB_to_notification{tag}_us_p50": round(statistics.median(lat) * 1e6, 1),
        f"kv_write_16KiB_to_handle_done{tag}_us_p50": round(statistics.median(done) * 1e6, 1),
    }


def _bench_raw_endpoints(pings: int) -> dict:
    """Baselines without the backend's threads: one thread posts a 16 KiB WRITE (+ seqword) on a
    raw Endpoint pair and spins on the CQ, or on the seqword at the target."""
    import statistics

    from vllm_disagg.transport.rdma.verbs import Device, Endpoint, HostBuffer

    dev = Device.get()
    a, b = Endpoint(dev), Endpoint(dev)
    src, dst = HostBuffer(16 << 10), HostBuffer((16 << 10) + 8)
    src_mr, dst_mr = dev.register(src.addr, src.nbytes), dev.register(dst.addr, dst.nbytes, remote_write=True)
    a.connect(b.info())
    b.connect(a.info())
    cq_lat, land_lat = [], []
    for i in range(1, pings + 1):
        src.view[:8] = i.to_bytes(8, "little")
        t0 = time.perf_counter()
        a.post_writes([(src.addr, 16 << 10, src_mr.lkey, dst.addr, dst_mr.rkey)], i)
        while not a.poll():
            pass
        cq_lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a.post_writes(
            [
                (src.addr, 16 << 10, src_mr.lkey, dst.addr, dst_mr.rkey),
                (src.addr, 8, src_mr.lkey, dst.addr + (16 << 10), dst_mr.rkey),
            ],
            i,
        )
        while int.from_bytes(dst.view[16 << 10 : (16 << 10) + 8], "little") != i:
            pass
        land_lat.append(time.perf_counter() - t0)
        while not a.poll():
            pass
    for x in (a, b):
        x.close()
    for x in (src_mr, dst_mr, src, dst):
        x.close()
    return {
        "raw_endpoint_16KiB_write_to_cqe_us_p50": round(statistics.median(cq_lat) * 1e6, 1),
        "raw_endpoint_16KiB_write_to_seqword_seen_us_p50": round(statistics.median(land_lat) * 1e6, 1),
    }


def _echo_n(lst, n: int) -> None:
    ch = lst.accept(timeout=20)
    buf = [memoryview(bytearray(16 << 10))]
    for _ in range(n):
        m = ch.recv(out=buf, timeout=30)
        ch.send(m.header, m.buffers)
    ch.close()


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def _child_receiver() -> None:
    rx = transport().kv_receiver(name="child-rx")
    rx.register_region("layer.0", blocks(4))
    print(rx.start(), flush=True)
    time.sleep(600)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child-receiver"]:
        _child_receiver()
        return 0
    if argv[:1] == ["--bench"]:
        try:
            bench()
            rc = 0
        except Exception:
            traceback.print_exc()
            rc = 1
        print(f"RDMA-SUITE DONE rc={rc} (bench)", flush=True)
        return rc
    names = argv or list(CASES)
    failures = 0
    for name in names:
        t0 = time.monotonic()
        log(f"case {name}")
        try:
            CASES[name]()
            print(f"RDMA-CASE PASS {name} {time.monotonic() - t0:.2f}s", flush=True)
        except Exception:
            failures += 1
            traceback.print_exc()
            print(f"RDMA-CASE FAIL {name} {time.monotonic() - t0:.2f}s", flush=True)
    print(f"RDMA-SUITE DONE rc={failures}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
