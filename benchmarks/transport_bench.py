# SPDX-License-Identifier: Apache-2.0
"""Transport benchmark: KV-block bandwidth and 16 KiB round trip of every backend that runs here,
in one run, against raw memcpy (numpy) and raw loopback TCP (plain sockets, second process).

Bandwidth: the parent pushes `--mib` MiB of KV-like blocks (one `write_blocks` per layer) to a
receiver in a child process; the clock stops when the child has seen the last notification
(data landed). Round trip: `send` 16 KiB + `recv` the echo into a preallocated buffer, p50.
Goals (issues 3 and 7): tcp >= 0.8x raw TCP; shm >= 0.9x NIXL bandwidth with a lower round trip.

    python benchmarks/transport_bench.py --quick     # < 2 min, prints one JSON object
    python benchmarks/transport_bench.py             # full run: results/transport_bench.json + .png
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # nixl/UCX: no NIC here, stay on loopback + shm

from vllm_disagg.transport import BlockWrite, TransportOptions, available_transports, get_transport  # noqa: E402
from vllm_disagg.transport.peers import kv_receiver_child, msg_echo_child, raw_tcp_child, wait_for  # noqa: E402

TOKEN = "bench-token"
BLOCK_ELEMS = 8 * 32 * 32  # 32 KiB float32 blocks: [kv_heads=8, block_size=32, 2*head_dim=32]
MSG_BYTES = 16 << 10
RESULTS = Path(__file__).parent / "results"


def _spawn(target, before: tuple, after: tuple = ()):
    """Start `target(*before, conn, *after)` in a spawn child; returns (process, parent conn)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*before, child, *after), daemon=True)
    proc.start()
    return proc, parent


def bench_memcpy(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def bench_raw_tcp(nbytes: int, repeats: int, rtt_iters: int) -> tuple[float, float]:
    """(GB/s, 16 KiB round-trip p50 in µs) of plain sockets between two processes."""
    import socket

    proc, conn = _spawn(raw_tcp_child, (), (nbytes, repeats, MSG_BYTES))
    port = wait_for(conn, "addr")[1]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(np.ones(nbytes, dtype=np.uint8))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        times.append(time.perf_counter() - t0)
    ping, pong = memoryview(bytearray(MSG_BYTES)), memoryview(bytearray(MSG_BYTES))
    rtts = []
    for i in range(rtt_iters):
        t0 = time.perf_counter()
        sock.sendall(ping)
        got = 0
        while got < MSG_BYTES:
            got += sock.recv_into(pong[got:], MSG_BYTES - got)
        if i >= rtt_iters // 10:
            rtts.append(time.perf_counter() - t0)
    sock.close()
    proc.join(10)
    return nbytes / statistics.median(times) / 1e9, statistics.median(rtts) * 1e6


def bench_kv_bandwidth(kind: str, nbytes: int, repeats: int) -> float:
    """GB/s of write_blocks to a receiver process, clocked until its last notification."""
    num_blocks = 64
    num_layers = max(1, nbytes // (num_blocks * BLOCK_ELEMS * 4))
    proc, conn = _spawn(kv_receiver_child, (kind, TOKEN), (num_layers, num_blocks, BLOCK_ELEMS))
    try:
        address = wait_for(conn, "addr", timeout=120)[1]
        tx = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=60)).kv_sender(name="bench")
        peer = tx.connect(address, timeout=60)
        srcs = [torch.randn(num_blocks, BLOCK_ELEMS) for _ in range(num_layers)]
        ids = list(range(num_blocks))
        times = []
        for rep in range(repeats + 1):  # the first round warms up connections and registrations
            t0 = time.perf_counter()
            handles = [
                peer.write_blocks([BlockWrite(f"layer.{i}", srcs[i], ids, ids)], f"r{rep}", i)
                for i in range(num_layers)
            ]
            last_seq = (rep + 1) * num_layers - 1
            while wait_for(conn, "notif", timeout=120)[3] != last_seq:
                pass
            for h in handles:
                h.wait(60)
            if rep:
                times.append(time.perf_counter() - t0)
        tx.close()
        return num_layers * num_blocks * BLOCK_ELEMS * 4 / statistics.median(times) / 1e9
    finally:
        conn.send(("exit",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def bench_rtt(kind: str, iters: int) -> float:
    """p50 µs of a 16 KiB send + echo recv into a preallocated buffer."""
    proc, conn = _spawn(msg_echo_child, (kind, TOKEN), ({}, MSG_BYTES))
    try:
        ch = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=30)).connect_msg(
            wait_for(conn, "addr", timeout=120)[1], timeout=60
        )
        x, out = torch.ones(MSG_BYTES // 4), torch.empty(MSG_BYTES // 4)
        rtts = []
        for i in range(iters + iters // 10):
            t0 = time.perf_counter()
            ch.send(b"q", [x])
            ch.recv(out=[out])
            if i >= iters // 10:
                rtts.append(time.perf_counter() - t0)
        ch.close()
        return statistics.median(rtts) * 1e6
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run(quick: bool, mib: int) -> dict:
    nbytes = mib << 20
    repeats, rtt_iters = (3, 300) if quick else (7, 2000)
    kinds = [k for k in ("tcp", "shm", "nixl") if available_transports()[k] is None]
    out: dict = {
        "memcpy_gbps": bench_memcpy(nbytes, repeats * 2),
        "bytes_per_transfer": nbytes,
        "box": {"cpus": os.cpu_count(), "load1": os.getloadavg()[0], "python": platform.python_version()},
        "skipped": {k: r for k, r in available_transports().items() if r and k in ("tcp", "shm", "nixl")},
    }
    out["raw_tcp_gbps"], out["rtt_us_raw_tcp"] = bench_raw_tcp(nbytes, repeats, rtt_iters)
    out["bw_gbps"], out["rtt_us"] = {}, {}
    for kind in kinds:
        out["bw_gbps"][kind] = bench_kv_bandwidth(kind, nbytes, repeats)
        out["rtt_us"][kind] = bench_rtt(kind, rtt_iters)
        out[f"rtt_us_{kind}"] = out["rtt_us"][kind]
        print(
            f"# {kind}: {out['bw_gbps'][kind]:.2f} GB/s, rtt p50 {out['rtt_us'][kind]:.0f} us",
            file=sys.stderr,
        )
    bw = out["bw_gbps"]
    out["tcp_vs_raw_tcp_ratio"] = bw["tcp"] / out["raw_tcp_gbps"] if "tcp" in bw else None
    out["shm_vs_nixl_bw_ratio"] = bw["shm"] / bw["nixl"] if {"shm", "nixl"} <= set(bw) else None
    out["shm_vs_memcpy_ratio"] = bw["shm"] / out["memcpy_gbps"] if "shm" in bw else None
    out["load1_after"] = os.getloadavg()[0]
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["memcpy", "raw tcp", *result["bw_gbps"]]
    vals = [result["memcpy_gbps"], result["raw_tcp_gbps"], *result["bw_gbps"].values()]
    a.bar(names, vals, color=["grey", "grey"] + ["C0"] * len(result["bw_gbps"]))
    a.set_ylabel("GB/s")
    a.set_title(f"{result['bytes_per_transfer'] >> 20} MiB of KV blocks, 2 processes")
    names = ["raw tcp", *result["rtt_us"]]
    vals = [result["rtt_us_raw_tcp"], *result["rtt_us"].values()]
    b.bar(names, vals, color=["grey"] + ["C1"] * len(result["rtt_us"]))
    b.set_ylabel("µs (p50)")
    b.set_title("16 KiB round trip")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats; prints one JSON object (< 2 min)"
    )
    parser.add_argument("--mib", type=int, default=64, help="bytes per bandwidth transfer, MiB")
    args = parser.parse_args()
    result = run(args.quick, args.mib)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "transport_bench.json").write_text(json.dumps(result, indent=2))
        plot(result, RESULTS / "transport_bench.png")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
