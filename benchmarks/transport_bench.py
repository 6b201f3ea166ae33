# SPDX-License-Identifier: Apache-2.0
"""Transport benchmark: every backend against what a user would run instead, in the same run.

Paired rounds: contenders alternate transfer by transfer; headlines are medians over rounds of
per-round ratios, with the load average recorded. Bandwidth: 64 MiB of KV-like blocks (one
`write_blocks` per layer), clocked until the receiver saw the last notification (its own clock).
Baselines (`transport_baselines.py`): memcpy (the limit), raw TCP at the push's number of streams,
raw NIXL at its best. Every receiver's CRC must match, or the run fails. Round trip: 16 KiB p50.
Goals (issue 14): push_vs_raw_tcp_same_streams >= 0.8, shm_vs_memcpy >= 0.7.

    python benchmarks/transport_bench.py --quick   # ~1 min, prints one JSON object with every key
    python benchmarks/transport_bench.py           # full, 3 runs: results/transport_bench.json + .png
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # nixl/UCX: no NIC here, stay on loopback + shm

sys.path.insert(0, str(Path(__file__).parent))
from transport_baselines import RawNixl, RawTcp, expect, spawn, stop  # noqa: E402

from vllm_disagg.testing.peers import crc32_of, kv_receiver_child, msg_echo_child  # noqa: E402
from vllm_disagg.transport import BlockWrite, TransportOptions, available_transports, get_transport  # noqa: E402

TOKEN = "bench-token"
BLOCK_ELEMS = 8 * 32 * 32  # 32 KiB float32 blocks: [kv_heads=8, block_size=32, 2*head_dim=32]
MSG_BYTES = 16 << 10
RESULTS = Path(__file__).parent / "results"
GOALS = {"push_vs_raw_tcp_same_streams": 0.8, "shm_vs_memcpy": 0.7}
HEADLINES = [*GOALS, "nixl_push_vs_raw_nixl", "rtt_nixl_msg_vs_raw_nixl", "rtt_tcp_vs_raw_tcp"]


class Memcpy:
    """One numpy copy of the same number of bytes inside one process: the limit. numpy asks for
    transparent huge pages; `small_pages` maps both buffers with 4 KiB pages instead, as a vLLM CPU KV
    cache (torch's allocator does not ask for huge pages) and the shm backend's shared mapping (shmem
    huge pages are off on this box) have them: a secondary key, splitting the shm gap into page size
    and our own cost."""

    def __init__(self, nbytes: int, small_pages: bool = False):
        self.src, self.dst = (_small_pages(nbytes), _small_pages(nbytes)) if small_pages else (
            np.empty(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8))
        self.src[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        np.copyto(self.dst, self.src)

    def bw(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            out.append(time.perf_counter() - t0)
        return out

    def verify(self) -> None:
        if not np.array_equal(self.dst, self.src):
            raise RuntimeError("memcpy baseline did not copy")

    def close(self) -> None:
        pass


def _small_pages(nbytes: int) -> np.ndarray:
    """A buffer of 4 KiB pages (no transparent huge pages), touched."""
    mm = mmap.mmap(-1, nbytes)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf[:] = 0
    return buf


class KVPush:
    """`write_blocks` of one layer per call to a receiver process; each transfer is clocked until
    the receiver saw its last notification (all bytes landed)."""

    def __init__(self, kind: str, nbytes: int, num_streams: int, num_blocks: int = 64):
        self.num_layers = max(1, nbytes // (num_blocks * BLOCK_ELEMS * 4))
        self.proc, self.conn = spawn(
            kv_receiver_child,
            kind,
            TOKEN,
            self.num_layers,
            num_blocks,
            BLOCK_ELEMS,
            self.num_layers,
            conn_at=2,
        )
        address = expect(self.conn, "addr")[1]
        options = TransportOptions(auth_token=TOKEN, timeout_s=60, num_streams=num_streams)
        self.tx = get_transport(kind, options).kv_sender(name="bench")
        self.peer = self.tx.connect(address, timeout=60)
        self.srcs = [torch.randn(num_blocks, BLOCK_ELEMS) for _ in range(self.num_layers)]
        self.ids = list(range(num_blocks))
        self.rounds = 0
        self.bw(1)  # warm up connections, registrations, page mappings

    def bw(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            handles = [
                self.peer.write_blocks([BlockWrite(f"layer.{i}", self.srcs[i], self.ids, self.ids)], "t", i)
                for i in range(self.num_layers)
            ]
            self.rounds += 1
            last_seq = self.rounds * self.num_layers - 1
            while (msg := expect(self.conn, "notif"))[3] != last_seq:
                pass
            out.append(msg[4] - t0)
            for h in handles:
                h.wait(60)
        return out

    def verify(self) -> None:
        self.conn.send(("crc",))
        if expect(self.conn, "crc")[1] != crc32_of(self.srcs):
            raise RuntimeError("KV push: the receiver's regions differ from the sources")

    def close(self) -> None:
        self.tx.close()
        stop(self.proc, self.conn)


class MsgEcho:
    """16 KiB `send` + echo `recv(out=...)` against a server process."""

    def __init__(self, kind: str):
        self.proc, conn = spawn(msg_echo_child, kind, TOKEN, {}, MSG_BYTES, conn_at=2)
        tr = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=30))
        self.ch = tr.connect_msg(expect(conn, "addr")[1], timeout=60)
        self.x, self.out = torch.ones(MSG_BYTES // 4), torch.empty(MSG_BYTES // 4)
        self.rtt(20)

    def rtt(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
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


def push_vs_raw_tcp(nbytes: int, num_streams: int, num_rounds: int, per_round: int) -> dict:
    """The push goal alone (used by pd_bench): tcp push vs raw TCP at `num_streams` streams."""
    raw, push = RawTcp(nbytes, num_streams, MSG_BYTES), KVPush("tcp", nbytes, num_streams)
    gbps: dict[str, list[float]] = {"raw": [], "push": []}
    try:
        for r in range(num_rounds):
            times = {"raw": 0.0, "push": 0.0}
            for j in range(per_round):
                for name, subject in _rotated([("raw", raw), ("push", push)], r + j):
                    times[name] += subject.bw(1)[0]
            for name, seconds in times.items():
                gbps[name].append(nbytes * per_round / seconds / 1e9)
        raw.verify()
        push.verify()
    finally:
        push.close()
        raw.close()
    return {
        "raw_tcp_gbps": statistics.median(gbps["raw"]),
        "tcp_push_gbps": statistics.median(gbps["push"]),
        "ratio": _median_ratio(gbps["push"], gbps["raw"]),
    }


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _rotated(items: list, shift: int) -> list:
    shift %= len(items)
    return items[shift:] + items[:shift]


def measure(quick: bool, mib: int, num_streams: int) -> dict:
    """Bandwidth then round trip, each in paired rounds (contender order rotated per round)."""
    nbytes = mib << 20
    num_rounds, per_round, rtt_per_round = (5, 3, 100) if quick else (11, 5, 200)
    report = available_transports()
    kinds = [k for k in ("tcp", "shm", "nixl") if report[k] is None]
    load_before = open("/proc/loadavg").read().split()[:3]
    raw = RawTcp(nbytes, num_streams, MSG_BYTES)
    bw_subjects = {"memcpy": Memcpy(nbytes), "memcpy_4k_pages": Memcpy(nbytes, small_pages=True), "raw_tcp": raw}
    if num_streams != 1:
        bw_subjects["raw_tcp_1_stream"] = RawTcp(nbytes, 1, MSG_BYTES)
    raw_nixl = RawNixl(nbytes, MSG_BYTES) if "nixl" in kinds else None
    if raw_nixl:
        bw_subjects["raw_nixl"] = raw_nixl
    bw_subjects.update({k: KVPush(k, nbytes, num_streams) for k in kinds})
    gbps: dict[str, list[float]] = {name: [] for name in bw_subjects}
    load1 = []
    for r in range(num_rounds):  # contenders alternate transfer by transfer: memory bandwidth swings
        times: dict[str, float] = dict.fromkeys(bw_subjects, 0.0)
        for j in range(per_round):
            for name in _rotated(list(bw_subjects), r + j):
                times[name] += bw_subjects[name].bw(1)[0]
        for name, seconds in times.items():
            gbps[name].append(nbytes * per_round / seconds / 1e9)
        load1.append(os.getloadavg()[0])
    for subject in bw_subjects.values():
        subject.verify()
    for name, subject in bw_subjects.items():  # idle receivers' pollers must not disturb the RTTs
        if name not in ("raw_tcp", "raw_nixl"):
            subject.close()
    rtt_subjects = {"raw_tcp": raw, **({"raw_nixl": raw_nixl} if raw_nixl else {})}
    rtt_subjects.update({k: MsgEcho(k) for k in kinds})
    rtts: dict[str, list[list[float]]] = {name: [] for name in rtt_subjects}
    for r in range(num_rounds):
        for name in _rotated(list(rtt_subjects), r):
            rtts[name].append(rtt_subjects[name].rtt(rtt_per_round))
        load1.append(os.getloadavg()[0])
    for subject in rtt_subjects.values():
        subject.close()
    return {
        "gbps": gbps,
        "rtts": rtts,
        "kinds": kinds,
        "skipped": {k: reason for k, reason in report.items() if reason and k in ("tcp", "shm", "nixl")},
        "load": {
            "loadavg_before": load_before,
            "loadavg_after": open("/proc/loadavg").read().split()[:3],
            "load1_per_round": [round(x, 2) for x in load1],
        },
        "config": {
            "quick": quick,
            "bytes_per_transfer": nbytes,
            "rounds": num_rounds,
            "transfers_per_round": per_round,
            "num_streams": num_streams,
            "rtt_samples_per_round": rtt_per_round,
        },
    }


def measure_runs(quick: bool, mib: int, num_streams: int, num_runs: int) -> dict:
    """`num_runs` independent runs (fresh processes, connections, buffers); their paired rounds
    are pooled for the headlines, and each run's own headlines are kept to show the spread."""
    runs = [measure(quick, mib, num_streams) for _ in range(num_runs)]
    per_run = [summarize(r) for r in runs]
    m = runs[0]
    for r in runs[1:]:
        for table in ("gbps", "rtts"):
            for name, rounds in r[table].items():
                m[table][name] += rounds
    m["load"] = {
        "loadavg_before": runs[0]["load"]["loadavg_before"],
        "loadavg_after": runs[-1]["load"]["loadavg_after"],
        "loadavg_after_each_run": [r["load"]["loadavg_after"] for r in runs],
        "load1_per_round": [x for r in runs for x in r["load"]["load1_per_round"]],
    }
    m["config"]["runs"] = num_runs
    m["per_run"] = {k: [s[k] for s in per_run] for k in HEADLINES}
    return m


def summarize(m: dict) -> dict:
    """Headlines: medians over rounds of per-round ratios (paired); never a best-of."""
    gbps, rtts = m["gbps"], m["rtts"]
    p50 = {name: [statistics.median(r) * 1e6 for r in rounds] for name, rounds in rtts.items()}
    everything = {name: sorted(x for r in rounds for x in r) for name, rounds in rtts.items()}

    def ratio(a: str, b: str, table: dict) -> float | None:
        return _median_ratio(table[a], table[b]) if a in table and b in table else None

    out: dict = {
        "quick": m["config"]["quick"],
        "push_vs_raw_tcp_same_streams": ratio("tcp", "raw_tcp", gbps),
        "shm_vs_memcpy": ratio("shm", "memcpy", gbps),
        "shm_vs_memcpy_4k_pages": ratio("shm", "memcpy_4k_pages", gbps),
        "memcpy_4k_pages_vs_memcpy": ratio("memcpy_4k_pages", "memcpy", gbps),
        "nixl_push_vs_raw_nixl": ratio("nixl", "raw_nixl", gbps),
        "shm_vs_raw_nixl": ratio("shm", "raw_nixl", gbps),
        "push_vs_raw_tcp_1_stream": ratio("tcp", "raw_tcp_1_stream", gbps),
        "rtt_nixl_msg_vs_raw_nixl": ratio("nixl", "raw_nixl", p50),
        "rtt_shm_vs_raw_nixl": ratio("shm", "raw_nixl", p50),
        "rtt_tcp_vs_raw_tcp": ratio("tcp", "raw_tcp", p50),
        "gbps": {name: statistics.median(v) for name, v in gbps.items()},
        "rtt_p50_us": {name: statistics.median(v) for name, v in p50.items()},
        "rtt_p90_us": {name: v[int(0.9 * len(v))] * 1e6 for name, v in everything.items()},
    }
    out["goals"] = {
        k: {"goal": g, "value": out[k], "met": out[k] is not None and out[k] >= g} for k, g in GOALS.items()
    }
    out.update(
        {
            "per_round_gbps": {k: [round(x, 3) for x in v] for k, v in gbps.items()},
            "per_round_rtt_p50_us": {k: [round(x, 1) for x in v] for k, v in p50.items()},
            "verified": "every receiver's CRC-32 matched its sender's bytes",
            "method": {
                "pairing": "each round alternates all contenders transfer by transfer; headline = "
                "median over rounds of the per-round ratio",
                "clock": "sender's first call -> receiver's own CLOCK_MONOTONIC stamp when it saw the data",
                "buffers": "torch CPU tensors on both sides (the KV cache's kind, 4 KiB pages); memcpy "
                "copies numpy arrays (transparent huge pages), the faster limit; memcpy_4k_pages the "
                "same copy between 4 KiB-page buffers (secondary: the page-size share of the shm gap)",
                "raw_tcp": "plain sockets, same number of streams as the push, one thread per stream",
                "raw_nixl": "registered once, prepared descriptor lists and handles re-posted; bulk "
                "polls with sched_yield, round trip spins (each its faster mode here)",
            },
            **m["config"],
            **({"per_run": m["per_run"]} if "per_run" in m else {}),
            "skipped": m["skipped"],
            "load": m["load"],
            "box": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        }
    )
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baselines = {"memcpy", "memcpy_4k_pages", "raw_tcp", "raw_tcp_1_stream", "raw_nixl"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, table, unit, title in (
        (
            a,
            result["gbps"],
            "GB/s (median of rounds)",
            f"{result['bytes_per_transfer'] >> 20} MiB of KV blocks",
        ),
        (b, result["rtt_p50_us"], "µs (p50, log scale)", "16 KiB round trip"),
    ):
        names = list(table)
        ax.bar(names, [table[n] for n in names], color=["grey" if n in baselines else "C0" for n in names])
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    b.set_yscale("log")
    load = result["load"]
    fig.suptitle(
        f"grey: baselines, same run; {result.get('runs', 1)} runs x {result['rounds']} paired rounds; "
        f"load1 {load['loadavg_before'][0]} -> {load['loadavg_after'][0]}; "
        f"push/raw tcp ({result['num_streams']} streams) {result['push_vs_raw_tcp_same_streams']:.2f}, "
        f"shm/memcpy {result['shm_vs_memcpy']:.2f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds, prints one JSON object (~1 min)")
    parser.add_argument("--mib", type=int, default=64, help="bytes per bandwidth transfer, MiB")
    parser.add_argument(
        "--streams",
        type=int,
        default=TransportOptions(auth_token="x").num_streams,
        help="streams of the tcp push and of its raw TCP baseline (default: the transport's default)",
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="independent runs, rounds pooled (default 1 quick, 3 full)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON (+ .png) here")
    args = parser.parse_args()
    num_runs = args.runs or (1 if args.quick else 3)
    result = summarize(measure_runs(args.quick, args.mib, args.streams, num_runs))
    out = args.out or (None if args.quick else RESULTS / "transport_bench.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        plot(result, out.with_suffix(".png"))
    for name, v in result["gbps"].items():
        print(
            f"# {name}: {v:.2f} GB/s, rtt p50 {result['rtt_p50_us'].get(name, float('nan')):.0f} us",
            file=sys.stderr,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
