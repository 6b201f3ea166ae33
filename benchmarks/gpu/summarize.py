# SPDX-License-Identifier: Apache-2.0
"""Medians of the GPU kit's headline figures over repeated runs on one machine.

A lent session can afford the four steps more than once (~2 min each on a warm machine), and a
headline is the median of >= 3 runs, never the best. Runs here, on the JSON the calls brought back.
    python benchmarks/gpu/summarize.py FOLDER [FOLDER ...] --out summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

HEADLINES = {
    "seqno_stream_write_poll_to_observe_us": ("a", "stream_write", "poll_to_observe_us", "median"),
    "seqno_peer_process_poll_to_observe_us": ("a", "peer_process_write", "poll_to_observe_us", "median"),
    "seqno_host_rtt_us": ("a", "host_write", "rtt_us", "median"),
    "stream_memops_host_rtt_us": ("a", "host_write_stream_memops", "rtt_us", "median"),
    "nanoflow_plain_step_ms": ("b", "executor", "runs", "plain", "step_ms", "median_ms"),
    "nanoflow_inline_speedup": ("b", "executor", "runs", "nano_inline", "speedup_vs_plain"),
    "nanoflow_plain_streams_speedup": ("b", "executor", "runs", "overlap_plain_streams", "speedup_vs_plain"),
    "nanoflow_green_96_speedup": ("b", "executor", "runs", "overlap_green_96", "speedup_vs_plain"),
    "nanoflow_green_66_speedup": ("b", "executor", "runs", "overlap_green_66", "speedup_vs_plain"),
    "lamina_round_trip_b1_c32_us": ("c", "round_trip", "rows", 0, "call_us"),
    "lamina_local_b1_c32_us": ("c", "round_trip", "rows", 0, "local_us"),
    "lamina_round_trip_b32_c1024_us": ("c", "round_trip", "rows", 1, "call_us"),
    "lamina_local_b32_c1024_us": ("c", "round_trip", "rows", 1, "local_us"),
    "copy_limit_gbs": ("d", "copy_limit", "plain_copy_gbs"),
    "cuda_ipc_push_gbs": ("d", "cuda_ipc_push", "push_gbs"),
    "cuda_ipc_exposed_after_forward_ms": ("d", "cuda_ipc_push", "exposed_after_forward_ms"),
    "nixl_push_gbs": ("d", "nixl_push", "push_gbs"),
    "nixl_exposed_after_forward_ms": ("d", "nixl_push", "exposed_after_forward_ms"),
}


def _figure(folder: Path, path: tuple) -> float:
    step, *keys = path
    value = json.loads((folder / f"gpu_check_{step}.json").read_text())["checks"]
    for key in keys:
        value = value[key]
    return value


def summarize(folders: list[Path]) -> dict:
    """One row per headline: every run's value and their median (the headline)."""
    first = json.loads((folders[0] / "gpu_check_a.json").read_text())["environment"]
    rows = {}
    for name, path in HEADLINES.items():
        values = [_figure(folder, path) for folder in folders]
        rows[name] = {"median": statistics.median(values), "runs": values}
    return {
        "gpu": first.get("gpu"),
        "driver": first.get("driver"),
        "num_runs": len(folders),
        "folders": [str(folder) for folder in folders],
        "headlines": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.write_text(json.dumps(summarize(args.folders), indent=1) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
