# SPDX-License-Identifier: Apache-2.0
"""serve_bench.py's figure: goodput, TTFT and TBT against rate per deployment, where TTFT goes, and the
planner's prediction against the measurement."""

from __future__ import annotations

from pathlib import Path

from vllm_disagg.planner.goodput import HEADLINE_SLO

_STAGES = (("plain_wait_for_step_ms", "wait for the step in flight"), ("plain_queue_ms", "queue"),
           ("plain_prefill_ms", "prefill (+1st token)"),
           ("prefill_wait_for_step_ms", "P: wait for the step in flight"), ("prefill_queue_ms", "P queue"),
           ("prefill_prefill_ms", "P prefill"), ("handoff_ms", "handoff (KV, hops)"),
           ("decode_prefill_ms", "D first step"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    deps = sorted({r["deployment"] for r in runs})
    fig, axes = plt.subplots(1, 5 if result.get("prediction") else 4, figsize=(24, 4.5))
    for i, dep in enumerate(deps):
        rows = sorted((r for r in runs if r["deployment"] == dep), key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        kw = {"color": f"C{i}", "label": dep, "marker": "o", "ls": "", "alpha": 0.7}
        axes[0].plot(rates, [100 * (r["goodput"][HEADLINE_SLO.key] or 0) for r in rows], **kw)
        axes[1].plot(rates, [r["ttft_p50_ms"] / 1e3 if r["ttft_p50_ms"] else None for r in rows], **kw)
        axes[1].plot(rates, [r["ttft_p99_ms"] / 1e3 if r["ttft_p99_ms"] else None for r in rows],
                     **{**kw, "marker": "^", "label": None})
        axes[2].plot(rates, [r["tbt_p99_ms"] for r in rows], **kw)
    axes[0].axhline(90, color="grey", ls="--", lw=0.8)
    axes[0].set(xlabel="rate (req/s)", ylabel="% requests in SLO", xscale="log",
                title=f"goodput: TTFT<={HEADLINE_SLO.ttft_s:g}s, every gap<={1e3 * HEADLINE_SLO.gap_s:g}ms")
    axes[1].set(xlabel="rate (req/s)", ylabel="s", xscale="log", yscale="log", title="TTFT P50 (o) and P99 (^)")
    axes[2].set(xlabel="rate (req/s)", ylabel="ms", xscale="log", yscale="log", title="TBT P99 over every gap")
    axes[0].legend(fontsize=7)
    _breakdown(axes[3], result)
    if result.get("prediction"):
        _prediction(axes[4], result["prediction"])
    fig.suptitle(f"{result['trace']['source'].split('/')[-1]}, {result['plan']['num_requests']} requests, "
                 f"SmolLM2-135M bf16, 2 cores; quick={result['quick']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _breakdown(ax, result: dict) -> None:
    """Mean TTFT by stage at the headline rate (medians over rounds)."""
    med = {d: v["headline"] for d, v in result["medians"].items() if "headline" in v}
    deps = sorted(med)
    if not deps:  # a --bisect-only run has no headline rounds
        ax.set_axis_off()
        return
    for j, dep in enumerate(deps):
        bottom = 0.0
        for k, (key, label) in enumerate(_STAGES):
            val = (med[dep]["breakdown"].get(key) or 0.0) / 1e3
            if val:
                ax.bar(j, val, bottom=bottom, color=f"C{k}", label=label if j == _first(med, key, deps) else None)
                bottom += val
        client = (med[dep]["breakdown"].get("client_ttft_mean_ms") or 0) / 1e3
        ax.plot([j - 0.4, j + 0.4], [client, client], "k-", lw=2)
    ax.set_xticks(range(len(deps)), deps, rotation=30, fontsize=7)
    ax.set(ylabel="s (mean)", title="where TTFT goes (black: client mean TTFT)")
    ax.legend(fontsize=6)


def _first(med: dict, key: str, deps: list[str]) -> int:
    return next((j for j, d in enumerate(deps) if med[d]["breakdown"].get(key)), -1)


def _prediction(ax, pred: dict) -> None:
    for i, row in enumerate(pred.get("points", [])):
        ax.plot(row["measured"], row["predicted"], "o", color=f"C{i % 10}", alpha=0.7)
    lim = [1e-2, max([1.0] + [max(r["measured"], r["predicted"]) for r in pred.get("points", [])])]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured", ylabel="predicted",
           title=f"planner vs measured (max error below saturation {pred.get('max_abs_error_below_saturation')})")
