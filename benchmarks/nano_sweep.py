# SPDX-License-Identifier: Apache-2.0
"""`num_nano_batches: "auto"` against the same engine without nano-batching, over a sweep of batch sizes.

Every engine prefills the largest batch once; the sweep then walks the batches down (every engine
aborts the same requests), and at each batch the engines take turns of a few decode steps timed
through `engine.step()`, so the decode steps carry exactly `batch` tokens. Per batch the figure is
the median over turns of the per-turn throughput ratio (auto / without).
"""

from __future__ import annotations

import statistics
import sys
import time

from bench_probes import median_ratio, placed


class SweepEngine:
    def __init__(self, name: str, llm, placement: tuple[set[int], int]):
        self.name, self.llm, self.placement = name, llm, placement
        self.ids: list[str] = []
        self.outs: dict = {}

    def step(self) -> float:
        t0 = time.perf_counter()
        for o in self.llm.llm_engine.step():
            self.outs[o.request_id] = o
        return time.perf_counter() - t0


def sweep(engines: dict[str, SweepEngine], batches: list[int], context: int, vocab: int, steps_per_turn: int,
          turns: int, num: str, den: str) -> dict:
    """{batch: paired ratio num/den (and `<name>_ratio` over den for any other engine), and each engine's
    median step ms}; tokens equal per engine."""
    from vllm import SamplingParams

    from vllm_disagg.testing import token_prompts

    batches = sorted(set(batches), reverse=True)
    max_tokens = 4 + len(batches) * (turns * steps_per_turn + 2) + 8
    prompts = token_prompts(batches[0], context, vocab=vocab, seed=context)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        with placed(*e.placement):
            e.ids = [f"{e.name}-{i}" for i in range(batches[0])]
            for rid, p in zip(e.ids, prompts):
                e.llm.llm_engine.add_request(rid, p, sp)
            while not all(rid in e.outs for rid in e.ids):
                e.step()
            e.step()
    out: dict = {}
    for batch in batches:
        times: dict[str, list[float]] = {n: [] for n in engines}
        for e in engines.values():
            if len(e.ids) > batch:
                e.llm.llm_engine.abort_request(e.ids[batch:])
                e.ids = e.ids[:batch]
                with placed(*e.placement):
                    e.step()
        for _ in range(turns):
            for name, e in engines.items():
                with placed(*e.placement):
                    times[name].append(statistics.median(e.step() for _ in range(steps_per_turn)) * 1e3)
        out[batch] = {"ratio": round(median_ratio(times[den], times[num]), 3),
                      **{f"{n}_ratio": round(median_ratio(times[den], times[n]), 3) for n in engines
                         if n not in (num, den)},
                      **{f"{n}_step_ms": round(statistics.median(t), 3) for n, t in times.items()}}
        print(f"[nano_bench] sweep batch {batch}: {out[batch]}", file=sys.stderr)
    tokens = {}
    for name, e in engines.items():
        with placed(*e.placement):
            while e.llm.llm_engine.has_unfinished_requests():
                e.step()
        tokens[name] = sorted((int(rid.rsplit("-", 1)[1]), list(o.outputs[0].token_ids)) for rid, o in e.outs.items())
    ref = next(iter(tokens.values()))
    return {"by_batch": out, "min": min(r["ratio"] for r in out.values()),
            "same_tokens": all(t == ref for t in tokens.values())}
