# SPDX-License-Identifier: Apache-2.0
"""Lamina restart benchmark (issue 4): what the attention servers' retained KV saves a restarted model worker.

Engine A, a model worker as `vllm-disagg up` runs it (`DisaggAttentionWorker` + `DisaggConnector`, two
head-wise attention servers), generates FIRST tokens for BATCH prompts of CONTEXT tokens and is shut
down: the servers keep the full blocks it registered. Then the replay of a restart, each prompt + A's
tokens as the router sends it, runs on the same servers in two new engines, one after the other:
- `reuse`: with the connector: it restores the retained full blocks and prefills only the tail;
- `recompute`: without it (what a restarted worker did before): it prefills every token again.
Each engine times ROUNDS replays of `generate(max_tokens=1)` (the replay's prefill; the retained set
stays, so every round restores again), then one replay with DECODE more tokens: `decode_step_ms_*`
is its median time between first and last token per token (vLLM's request stats; median of
DECODE_REPS runs), with the connector's per-step block registrations and without. The two engines
run one after the other, so on a shared box this pair measures the load as much as the connector
(a cProfile of the decode steps puts the connector's hooks at ~0.3 ms of a ~90 ms step). `replay_prefill_speedup` = recompute / reuse, medians. The
greedy tokens of both must be equal (`tokens_equal`); `restored_blocks_per_server_per_replay` comes
from the servers' counter.

    python benchmarks/reuse_bench.py --quick   # < 5 min, prints one JSON object; results/reuse_bench_quick.*
    python benchmarks/reuse_bench.py           # more rounds and a longer context; results/reuse_bench.*
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TOKEN = "reuse-bench-token"
# a model with real prefill work per token on this CPU box (attn_bench.py's MEDIUM)
MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=1024)
CONNECTOR = {"kv_connector": "DisaggConnector", "kv_connector_module_path": "vllm_disagg.kv.connector",
             "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"
FIRST = 16
DECODE = 32
DECODE_REPS = 3


def _engine(model_dir: str, servers: list, connector: bool, max_len: int):
    from vllm import LLM

    from vllm_disagg.testing import tiny_llm_kwargs

    extra = {"kv_transfer_config": CONNECTOR} if connector else {}
    remote = {"servers": [s.http for s in servers], "partition": "head"}
    return LLM(**tiny_llm_kwargs(model_dir, worker_cls=WORKER, max_model_len=max_len, max_num_batched_tokens=8192,
                                 disable_log_stats=False,  # per-request first/last token times
                                 additional_config={"disagg": {"remote_attention": remote}}, **extra))


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _generate(llm, prompts: list[list[int]], max_tokens: int):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _restored(servers) -> list[float]:
    out = []
    for s in servers:
        with urllib.request.urlopen(f"http://{s.http}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        out.append(sum(float(x.split()[-1]) for x in lines
                       if x.startswith("vllm:disagg_attention_restored_blocks_total ")))
    return out


def _replays(llm, prompts: list[list[int]], rounds: int) -> dict:
    """ROUNDS timed replays (prefill + 1 token) in one engine, then one with DECODE more tokens: the
    difference over DECODE is the time per decode step, where the connector's per-step registrations
    are the only difference between the two engines."""
    times, tokens, cached = [], None, None
    for _ in range(rounds):
        t0 = time.perf_counter()
        tokens, cached = _generate(llm, prompts, 1)
        times.append(time.perf_counter() - t0)
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1 + DECODE, temperature=0, ignore_eos=True)
    tbts = []
    for _ in range(DECODE_REPS):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        tbts.append(statistics.median((o.metrics.last_token_ts - o.metrics.first_token_ts) / DECODE for o in outs))
    return {"seconds": times, "median_s": statistics.median(times), "tokens": tokens, "cached_tokens": cached,
            "decode_step_ms": statistics.median(tbts) * 1e3, "decode_step_ms_reps": [t * 1e3 for t in tbts],
            "decode_tokens": [list(o.outputs[0].token_ids) for o in outs]}


def run(batch: int, context: int, rounds: int) -> dict:
    from vllm_disagg.testing import make_tiny_llama, token_prompts
    from vllm_disagg.testing.attention import start_local_servers

    model_dir = str(make_tiny_llama(tempfile.mkdtemp(prefix="reuse-bench-"), weights=True, **MODEL))
    prompts = [p["prompt_token_ids"] for p in token_prompts(batch, context, vocab=MODEL["vocab_size"], seed=7)]
    max_len = context + FIRST + 64
    servers = start_local_servers(2, transport="shm", kv_cache_gib=0.5, env={"VLLM_DISAGG_AUTH_TOKEN": TOKEN})
    try:
        llm = _engine(model_dir, servers, True, max_len)  # engine A: the worker that will "die"
        try:
            first, _ = _generate(llm, prompts, FIRST)
        finally:
            _close(llm)
        replayed = [p + g for p, g in zip(prompts, first)]
        before = _restored(servers)
        llm = _engine(model_dir, servers, True, max_len)
        try:
            reuse = _replays(llm, replayed, rounds)
        finally:
            _close(llm)
        restored = [a - b for a, b in zip(_restored(servers), before)]
        llm = _engine(model_dir, servers, False, max_len)
        try:
            recompute = _replays(llm, replayed, rounds)
        finally:
            _close(llm)
    finally:
        for s in servers:
            s.stop()
    return {"reuse": reuse, "recompute": recompute, "restored_blocks": restored, "replay_tokens": len(replayed[0])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 5 min: batch 8, context 1024, 3 rounds")
    args = ap.parse_args()
    os.environ["VLLM_DISAGG_AUTH_TOKEN"] = TOKEN
    from vllm_disagg.testing import apply_test_env

    apply_test_env(in_process=True)
    batch, context, rounds = (8, 1024, 3) if args.quick else (8, 2048, 5)
    res = run(batch, context, rounds)
    reuse, recompute = res["reuse"], res["recompute"]
    out = {
        "replay_prefill_s_reuse": round(reuse["median_s"], 4),
        "replay_prefill_s_recompute": round(recompute["median_s"], 4),
        "replay_prefill_speedup": round(recompute["median_s"] / reuse["median_s"], 3),
        "restored_blocks_per_server_per_replay": [b / (rounds + DECODE_REPS) for b in res["restored_blocks"]],
        "cached_tokens_per_request_reuse": reuse["cached_tokens"],
        "tokens_equal": reuse["tokens"] == recompute["tokens"] and reuse["decode_tokens"] == recompute["decode_tokens"],
        "decode_step_ms_with_connector": round(reuse["decode_step_ms"], 2),
        "decode_step_ms_without_connector": round(recompute["decode_step_ms"], 2),
        "batch": batch, "context": context, "replay_tokens": res["replay_tokens"], "rounds": rounds,
        "num_layers": MODEL["num_hidden_layers"], "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "reuse_bench_quick" if args.quick else "reuse_bench"
    full = {**out, "seconds": {"reuse": reuse["seconds"], "recompute": recompute["seconds"]},
            "decode_step_ms_reps": {"with_connector": reuse["decode_step_ms_reps"],
                                    "without_connector": recompute["decode_step_ms_reps"]}}
    (RESULTS / f"{stem}.json").write_text(json.dumps(full, indent=1))
    _plot(full, RESULTS / f"{stem}.png")
    print(json.dumps(out))
    return 0 if out["tokens_equal"] else 1


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["recompute", "reuse"]
    ax.bar(names, [res["replay_prefill_s_recompute"], res["replay_prefill_s_reuse"]], color=["#999", "#2a7"])
    for name in names:
        ax.scatter([name] * len(res["seconds"][name]), res["seconds"][name], color="k", s=8, zorder=3)
    ax.set_ylabel("replay prefill, s (median, rounds as dots)")
    ax.set_title(f"restarted model worker: batch {res['batch']} x {res['replay_tokens']} tokens\n"
                 f"reuse {res['replay_prefill_speedup']}x faster, {res['restored_blocks_per_server_per_replay'][0]:.0f} "
                 "blocks restored per server", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
