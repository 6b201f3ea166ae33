# SPDX-License-Identifier: Apache-2.0
"""Lamina's own claim on this box: memory, not compute, caps the decode batch.

One workload (`vllm_disagg.testing.workloads.long_context_requests`: requests whose context spans
2-8k tokens, decoding a fixed length, no shared prefix), all submitted at once, run to completion by
vLLM's own loop (`engine.step()`), in three kinds of runs on the same two cores:
- `plain`: plain vLLM on both cores (the placement that won the equal-cores turns of the same run)
  with a fixed KV space (`kv_cache_memory_bytes`): a small one caps the running batch, and vLLM
  preempts (recompute) what does not fit;
- `lamina`: the model worker on core 0 holding no KV, one attention server on core 1 holding several
  times that space, 2 nano-batches in flight (`num_nano_batches: auto` on the composed worker);
- the same plain vLLM given the model node's and the servers' memory together (the "same box" figure).
Per run: output tokens/s over the decode-only steps (the claim: the batch decodes faster) and end to
end (prefills and recomputed preemptions included), the running batch per decode step, and vLLM's
own preemption counter (`LLM.get_metrics()`, `vllm:num_preemptions`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

from bench_probes import MODEL_CORE, Probes, placed, runner_of
from bench_probes import probes as get_probes
from lamina_cores import NANO_REMOTE_WORKER, close_engine

GIB = 1 << 30
# Lamina's regime is a model whose weights are large next to one request's KV: here 6x at 4k tokens
# (one KV head of 64, 8 query heads; SmolLM2-135M in bf16: 2.9x; Llama-3-8B in bf16: 27x)
CAPACITY_MODEL = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=1, head_dim=64, vocab_size=1024, max_position_embeddings=16384)


@dataclass(frozen=True)
class Run:
    name: str
    kind: str
    """plain | lamina"""
    kv_bytes: int
    """plain: the engine's KV space; lamina: the attention server's (the model worker holds none)."""


def kv_per_token(model: dict, dtype_bytes: int = 4) -> int:
    from vllm_disagg.testing.workloads import kv_bytes_per_token

    return kv_bytes_per_token(model["num_hidden_layers"], model["num_key_value_heads"], model["head_dim"],
                              dtype_bytes)


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def run_once(model_dir: str, requests: list, run: Run, plain_placement: tuple[set[int], int], probes: Probes,
             token: str) -> dict:
    """One run of the whole workload; see the module docstring for what is measured."""
    from vllm import LLM

    from vllm_disagg.testing import tiny_llm_kwargs

    max_len = max(r.context for r in requests) + 16
    common = dict(block_size=128, max_num_batched_tokens=2048, max_num_seqs=256, disable_log_stats=False,
                  max_model_len=max_len, enable_prefix_caching=False)
    server = None
    if run.kind == "lamina":
        from lamina_rtt import start_servers

        server = start_servers({"cap": ("shm", "cpu", True)}, kv_cache_gib=run.kv_bytes / GIB)["cap"]
        ra = {"servers": [server.http], "pipeline": 2, "spin_us": 0.0}
        extra = dict(worker_cls=NANO_REMOTE_WORKER, additional_config={"disagg": {
            "remote_attention": ra, "nanoflow": {"num_nano_batches": "auto"}}})
        placement = ({MODEL_CORE}, 1)
    else:
        extra = dict(kv_cache_memory_bytes=run.kv_bytes)
        placement = plain_placement
    # plain: VLLM_CPU_KVCACHE_SPACE (the test environment sets it) would override kv_cache_memory_bytes;
    # lamina: the model worker reports the server's blocks, the env only satisfies vLLM's memory check
    space = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if run.kind == "plain" else None
    try:
        with placed(*placement):
            llm = LLM(**tiny_llm_kwargs(model_dir, **common, **extra))
            try:
                probes.engine = run.name
                probes.watch_runner(runner_of(llm))
                return _drive(llm, requests, run, probes)
            finally:
                close_engine(llm)
    finally:
        if space is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = space
        if server is not None:
            server.stop()


def _drive(llm, requests: list, run: Run, probes: Probes) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    preempt0 = _counter(llm, "vllm:num_preemptions")
    generated: dict[str, int] = {}
    steps: list[tuple[float, int, int]] = []  # (seconds, outputs with a new token, tokens in the forward)
    t_start = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        probes.last_num_tokens = 0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = 0
        for o in outs:
            n = len(o.outputs[0].token_ids)
            new += n > generated.get(o.request_id, 0)
            generated[o.request_id] = n
        steps.append((dt, new, probes.last_num_tokens))
    wall = time.perf_counter() - t_start
    decode = [(dt, new) for dt, new, tokens in steps if new and tokens == new]  # every token was a decode
    batches = [new for _, new in decode]
    out_tokens = sum(generated.values())
    result = {
        "name": run.name, "kind": run.kind, "kv_gib": round(run.kv_bytes / GIB, 4),
        "decode_tokens_per_s": round(sum(batches) / max(sum(dt for dt, _ in decode), 1e-9), 1),
        "end_to_end_output_tokens_per_s": round(out_tokens / wall, 1),
        "mean_decode_batch": round(statistics.fmean(batches), 2) if batches else 0.0,
        "max_decode_batch": max(batches, default=0),
        "preemptions": int(_counter(llm, "vllm:num_preemptions") - preempt0),
        "output_tokens": out_tokens, "wall_s": round(wall, 2), "steps": len(steps), "decode_steps": len(decode),
    }
    print(f"[attn_bench] capacity {run.name}: {result}", file=sys.stderr)
    return result


def run_capacity(model_dir: str, requests: list, runs: list[Run], rounds: int, extra: list[Run],
                 plain_placement: tuple[set[int], int], token: str) -> dict:
    """`runs` in `rounds` interleaved rounds (paired), then each of `extra` once (curve points)."""
    probes = get_probes()
    by_name: dict[str, list[dict]] = {r.name: [] for r in runs + extra}
    for _ in range(rounds):
        for run in runs:
            by_name[run.name].append(run_once(model_dir, requests, run, plain_placement, probes, token))
    for run in extra:
        by_name[run.name].append(run_once(model_dir, requests, run, plain_placement, probes, token))
    return by_name


def ratio(by_name: dict, num: str, den: str, key: str = "decode_tokens_per_s") -> float:
    """Median over rounds of num/den (paired: round i of each)."""
    return round(statistics.median(a[key] / b[key] for a, b in zip(by_name[num], by_name[den])), 3)
