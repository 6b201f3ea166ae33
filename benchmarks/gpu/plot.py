# SPDX-License-Identifier: Apache-2.0
"""One figure of the GPU kit's results (`benchmarks/results/gpu/gpu_check_{a,b,c,d}.json`).

Runs here, not on the lent machine: the device call's minutes go to measuring. Each panel puts the
project's path beside its baseline (the whole device, in-process attention, the copy limit).
    python benchmarks/gpu/plot.py [results folder]   ->  <folder>/gpu_check.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"


def _load(folder: Path, step: str) -> dict:
    return json.loads((folder / f"gpu_check_{step}.json").read_text())["checks"]


def _sm_share(ax, b: dict) -> None:
    rows = b["gemm_vs_sm_share"]["rows"]
    ax.plot([r["sm_granted"] for r in rows], [r["fraction_of_full"] for r in rows], "o-", label="GEMM on a green context")
    ax.plot([0, 132], [0, 1], ":", color="grey", label="linear in SMs")
    ax.set(xlabel="SMs granted", ylabel="fraction of whole-device TFLOP/s", title="b: GEMM vs SM share")
    ax.legend(fontsize=7)


def _executor(ax, b: dict) -> None:
    runs = b["executor"]["runs"]
    names = list(runs)
    ax.bar(names, [runs[n]["speedup_vs_plain"] for n in names])
    ax.axhline(1.0, color="grey", ls=":")
    ax.set(ylabel="speedup vs one batch", title="b: nano-batch executor, LLaMA-3-8B layer x8")
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)


def _round_trip(ax, c: dict) -> None:
    rows = c["round_trip"]["rows"]
    labels = [f"b{r['batch']} ctx{r['context']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["local_us"] for r in rows], 0.4, label="in-process (baseline)")
    ax.bar([i + 0.2 for i in x], [r["call_us"] for r in rows], 0.4, label="attention server (shm)")
    ax.set_xticks(list(x), labels)
    ax.set(ylabel="µs per layer call", title="c: remote attention round trip")
    ax.legend(fontsize=7)


def _push(ax, d: dict) -> None:
    bars = {"copy limit": d["copy_limit"]["plain_copy_gbs"], "block gather": d["copy_limit"]["block_gather_scatter_gbs"],
            "CUDA IPC push": d["cuda_ipc_push"].get("push_gbs"), "nixl push": d["nixl_push"].get("push_gbs")}
    names = [n for n, v in bars.items() if v]
    ax.bar(names, [bars[n] for n in names])
    ax.set_yscale("log")
    ax.set(ylabel="GB/s (payload)", title="d: layer-wise KV push, 1 GiB")
    ax.tick_params(axis="x", labelsize=7)


def plot(folder: Path = RESULTS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, c, d = (_load(folder, s) for s in "bcd")
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _sm_share(axes[0][0], b)
    _executor(axes[0][1], b)
    _round_trip(axes[1][0], c)
    _push(axes[1][1], d)
    gpu = json.loads((folder / "gpu_check_b.json").read_text())["environment"].get("gpu", "GPU")
    fig.suptitle(f"GPU kit on one {gpu} (benchmarks/results/gpu)")
    fig.tight_layout()
    out = folder / "gpu_check.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
