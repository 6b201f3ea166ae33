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

from vllm_disagg.testing.peers import kv_receiver_child, msg_echo_child, raw_tcp_child, wait_for  # noqa: E402
from vllm_disagg.transport import BlockWrite, TransportOptions, available_transports, get_transport  # noqa: E402

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


class Memcpy:
    """numpy copy of the same bytes inside one process: the physical ceiling."""

    def __init__(self, nbytes: int):
        self.src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)

    def bw_once(self, rep: int) -> float:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class RawTcp:
    """Plain sockets between two processes: sendall + recv_into a preallocated buffer, 1-byte ack;
    then 16 KiB ping-pong on the same connection."""

    def __init__(self, nbytes: int, repeats: int):
        import socket

        self.proc, conn = _spawn(raw_tcp_child, (), (nbytes, repeats, MSG_BYTES))
        self.sock = socket.create_connection(("127.0.0.1", wait_for(conn, "addr")[1]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = memoryview(np.ones(nbytes, dtype=np.uint8))
        self.ping, self.pong = memoryview(bytearray(MSG_BYTES)), memoryview(bytearray(MSG_BYTES))

    def bw_once(self, rep: int) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.payload)
        self.sock.recv(1)
        return time.perf_counter() - t0

    def rtt_batch(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.sock.sendall(self.ping)
            got = 0
            while got < MSG_BYTES:
                got += self.sock.recv_into(self.pong[got:], MSG_BYTES - got)
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.sock.close()
        self.proc.join(10)


class KVPush:
    """`write_blocks` of one layer per call to a receiver process; clocked until its last
    notification (all bytes landed)."""

    def __init__(self, kind: str, nbytes: int, num_streams: int, num_blocks: int = 64):
        self.num_layers = max(1, nbytes // (num_blocks * BLOCK_ELEMS * 4))
        self.proc, self.conn = _spawn(
            kv_receiver_child, (kind, TOKEN), (self.num_layers, num_blocks, BLOCK_ELEMS, self.num_layers)
        )
        address = wait_for(self.conn, "addr", timeout=120)[1]
        self.tx = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=60)).kv_sender(
            name="bench"
        )
        self.peer = self.tx.connect(address, timeout=60)
        self.srcs = [torch.randn(num_blocks, BLOCK_ELEMS) for _ in range(self.num_layers)]
        self.ids = list(range(num_blocks))
        self.rounds = 0
        self.bw_once(-1)  # warm up connections, registrations, page mappings

    def bw_once(self, rep: int) -> float:
        t0 = time.perf_counter()
        handles = [
            self.peer.write_blocks([BlockWrite(f"layer.{i}", self.srcs[i], self.ids, self.ids)], f"r{rep}", i)
            for i in range(self.num_layers)
        ]
        self.rounds += 1
        last_seq = self.rounds * self.num_layers - 1
        while wait_for(self.conn, "notif", timeout=120)[3] != last_seq:
            pass
        for h in handles:
            h.wait(60)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.tx.close()
        self.conn.send(("exit",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class MsgEcho:
    """16 KiB `send` + echo `recv(out=...)` against a server process."""

    def __init__(self, kind: str):
        self.proc, conn = _spawn(msg_echo_child, (kind, TOKEN), ({}, MSG_BYTES))
        tr = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=30))
        self.ch = tr.connect_msg(wait_for(conn, "addr", timeout=120)[1], timeout=60)
        self.x, self.out = torch.ones(MSG_BYTES // 4), torch.empty(MSG_BYTES // 4)
        self.rtt_batch(20)

    def rtt_batch(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.ch.send(b"q", [self.x])
            self.ch.recv(out=[self.out])
            out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.ch.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def run(quick: bool, mib: int, num_streams: int) -> dict:
    """All measurements interleaved round-robin, so load changes on a shared box hit every
    contender alike; medians over rounds."""
    nbytes = mib << 20
    repeats, rtt_rounds, rtt_per_round = (5, 5, 60) if quick else (11, 10, 200)
    report = available_transports()
    kinds = [k for k in ("tcp", "shm", "nixl") if report[k] is None]
    load_before = os.getloadavg()[0]
    raw = RawTcp(nbytes, repeats)
    bw_subjects = {
        "memcpy": Memcpy(nbytes),
        "raw_tcp": raw,
        **{k: KVPush(k, nbytes, num_streams) for k in kinds},
    }
    times: dict[str, list[float]] = {name: [] for name in bw_subjects}
    for rep in range(repeats):
        for name, subject in bw_subjects.items():
            times[name].append(subject.bw_once(rep))
    rtt_subjects = {"raw_tcp": raw, **{k: MsgEcho(k) for k in kinds}}
    rtts: dict[str, list[float]] = {name: [] for name in rtt_subjects}
    for _ in range(rtt_rounds):
        for name, subject in rtt_subjects.items():
            rtts[name] += subject.rtt_batch(rtt_per_round)
    for subject in [*bw_subjects.values(), *rtt_subjects.values()]:
        if subject is not raw:
            subject.close()
    raw.close()
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    if "memcpy" in gbps:
        gbps["memcpy"] = nbytes / min(times["memcpy"]) / 1e9  # ceiling: best of
    rtt_us = {name: statistics.median(r) * 1e6 for name, r in rtts.items()}
    rtt_p90 = {name: sorted(r)[int(0.9 * len(r))] * 1e6 for name, r in rtts.items()}
    out: dict = {
        "memcpy_gbps": gbps["memcpy"],
        "raw_tcp_gbps": gbps["raw_tcp"],
        "rtt_us_raw_tcp": rtt_us["raw_tcp"],
        "bw_gbps": {k: gbps[k] for k in kinds},
        "rtt_us": {k: rtt_us[k] for k in kinds},
        "rtt_p90_us": rtt_p90,
        "bw_times_ms": {name: [round(x * 1e3, 1) for x in t] for name, t in times.items()},
        **{f"rtt_us_{k}": rtt_us[k] for k in kinds},
        "tcp_vs_raw_tcp_ratio": gbps["tcp"] / gbps["raw_tcp"] if "tcp" in gbps else None,
        "tcp_vs_raw_tcp_ratio_best_of": min(times["raw_tcp"]) / min(times["tcp"]) if "tcp" in times else None,
        "shm_vs_nixl_bw_ratio_best_of": (
            min(times["nixl"]) / min(times["shm"]) if {"shm", "nixl"} <= set(times) else None
        ),
        "shm_vs_nixl_bw_ratio": gbps["shm"] / gbps["nixl"] if {"shm", "nixl"} <= set(gbps) else None,
        "shm_vs_nixl_rtt_ratio": rtt_us["shm"] / rtt_us["nixl"] if {"shm", "nixl"} <= set(rtt_us) else None,
        "shm_vs_memcpy_ratio": gbps["shm"] / gbps["memcpy"] if "shm" in gbps else None,
        "bytes_per_transfer": nbytes,
        "repeats": repeats,
        "tcp_streams": num_streams,
        "rtt_samples": rtt_rounds * rtt_per_round,
        "skipped": {k: r for k, r in report.items() if r and k in ("tcp", "shm", "nixl")},
        "box": {
            "cpus": os.cpu_count(),
            "load1_before": load_before,
            "load1_after": os.getloadavg()[0],
            "python": platform.python_version(),
        },
    }
    for k in kinds:
        print(f"# {k}: {gbps[k]:.2f} GB/s, rtt p50 {rtt_us[k]:.0f} us", file=sys.stderr)
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
    b.set_ylabel("µs (p50, log scale)")
    b.set_yscale("log")
    b.set_title("16 KiB round trip")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats; prints one JSON object (< 2 min)"
    )
    parser.add_argument("--mib", type=int, default=64, help="bytes per bandwidth transfer, MiB")
    parser.add_argument(
        "--streams", type=int, default=2, help="tcp streams per KV peer (TransportOptions.num_streams)"
    )
    args = parser.parse_args()
    result = run(args.quick, args.mib, args.streams)
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "transport_bench.json").write_text(json.dumps(result, indent=2))
        plot(result, RESULTS / "transport_bench.png")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
