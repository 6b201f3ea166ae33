# SPDX-License-Identifier: Apache-2.0
"""Terminal tables and matplotlib figures for `vllm-disagg plan`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def table(rows: Sequence[dict], columns: Sequence[str], title: str = "") -> str:
    """Fixed-width text table; floats get 2 decimals (4 significant if small)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(_align(r.get(c), v, w) for c, v, w in zip(columns, row, widths))
              for r, row in zip(rows, cells)]
    return "\n".join(lines)


def _align(raw, text: str, width: int) -> str:
    return text.rjust(width) if isinstance(raw, (int, float)) else text.ljust(width)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1 and v else f"{v:,.2f}"
    return str(v)


def key_values(pairs: dict, title: str = "") -> str:
    width = max((len(k) for k in pairs), default=0)
    lines = [title] if title else []
    lines += [f"{k.ljust(width)}  {_fmt(v)}" for k, v in pairs.items()]
    return "\n".join(lines)


def dump_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bandwidth(curves: dict[str, tuple[list[int], list[float]]], limit_gbs: float,
                   path: str | Path, title: str) -> None:
    """Lamina Fig. 4: required bandwidth (GB/s) vs batch size, one line per case."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=label)
    ax.axhline(limit_gbs, ls="--", c="grey", label=f"{limit_gbs:g} GB/s")
    ax.set(xlabel="batch size", ylabel="required bandwidth per compute GPU (GB/s)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_design_space(cands: list[dict], best: dict | None, path: str | Path,
                      title: str, metric: str = "cost_per_hour") -> None:
    """Splitwise Fig. 12: prompt x token machines, SLO-feasible points coloured."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    ok = [c for c in cands if c["ok"]]
    bad = [c for c in cands if not c["ok"]]
    if bad:
        ax.scatter([c["num_prompt"] for c in bad], [c["num_token"] for c in bad], marker="x",
                   c="lightgrey", label="misses an SLO")
    if ok:
        sc = ax.scatter([c["num_prompt"] for c in ok], [c["num_token"] for c in ok],
                        c=[c[metric] for c in ok], cmap="viridis", label="meets all SLOs")
        fig.colorbar(sc, ax=ax, label=metric)
    if best:
        ax.scatter([best["num_prompt"]], [best["num_token"]], marker="*", s=250, c="red",
                   label=f"optimum ({best['num_prompt']}P, {best['num_token']}T)")
    ax.set(xlabel="# prompt machines", ylabel="# token machines", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(cands: list[dict], path: str | Path, title: str) -> None:
    """Max SLO-meeting RPS for each prompt/token split of a fixed budget."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [c["num_prompt"] for c in cands]
    ax.plot(xs, [c["rps"] for c in cands], marker="o")
    ax.set(xlabel="# prompt machines (rest of budget = token machines)",
           ylabel="max RPS meeting SLOs", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ops(rows: list[dict], path: str | Path, title: str) -> None:
    """NanoFlow Table 2 as grouped bars: T_compute / T_mem / T_net per op."""
    plt = _pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate([("t_compute_ms", "compute"), ("t_mem_ms", "memory"),
                                      ("t_net_ms", "network")]):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, [r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="ms per iteration", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
