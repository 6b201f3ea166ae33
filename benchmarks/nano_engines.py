# SPDX-License-Identifier: Apache-2.0
"""nano_bench.py's engine runs: in-process `LLM()` engines on pinned cores, timed in turns (A B A B)
so that a shared, noisy box hits every engine alike, and the paired medians read from them."""

from __future__ import annotations

import gc
import statistics
import time

NANO_WORKER = "vllm_disagg.nanoflow.worker.NanoFlowCPUWorker"


def placed(cpus, threads):
    from bench_probes import placed as _placed

    return _placed(cpus, threads)


def open_engine(model_dir: str, **extra):
    from vllm import LLM

    from vllm_disagg.testing import tiny_llm_kwargs

    return LLM(**tiny_llm_kwargs(model_dir, **{"max_num_batched_tokens": 512, "max_num_seqs": 64, **extra}))


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def interleaved(engines: dict, prompts: list, max_tokens: int, reps: int) -> dict:
    """Time the engines in turn, `reps` rounds (A B A B ...): a shared, noisy box hits both alike.

    Returns per engine: tokens/s per round, the token ids, and nanoflow stats where available."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts) + max_tokens * len(prompts)
    out = {name: {"tokens_per_s": []} for name in engines}
    for llm in engines.values():
        llm.generate(prompts[:4], sp, use_tqdm=False)  # warm-up
    for _ in range(reps):
        for name, llm in engines.items():
            res, secs = timed(llm, prompts, sp)
            out[name]["tokens_per_s"].append(tokens / secs)
            out[name]["token_ids"] = [list(o.outputs[0].token_ids) for o in res]
    for name, llm in engines.items():
        try:
            out[name]["stats"] = llm.collective_rpc("nanoflow_stats")[0]
        except Exception:  # plain workers have no such method
            out[name]["stats"] = None
    return out


def timed(llm, prompts, sp):
    t0 = time.perf_counter()
    res = llm.generate(prompts, sp, use_tqdm=False)
    return res, time.perf_counter() - t0


def paired_ratio(runs: dict, num: str, den: str) -> float:
    """Median over rounds of num/den throughput."""
    return statistics.median(a / b for a, b in zip(runs[num]["tokens_per_s"], runs[den]["tokens_per_s"]))


def with_engines(configs: dict, fn):
    engines = {}
    try:
        for name, (model_dir, extra) in configs.items():
            engines[name] = open_engine(model_dir, **extra)
        return fn(engines)
    finally:
        for llm in engines.values():
            close_engine(llm)


def nano_cfg(nanoflow: dict, **sections) -> dict:
    return {"additional_config": {"disagg": {"nanoflow": nanoflow, **sections}}}


def summary(runs: dict, num: str, den: str, prefix: str) -> dict:
    return {
        f"{prefix}_{num}_tokens_per_s": statistics.median(runs[num]["tokens_per_s"]),
        f"{prefix}_{den}_tokens_per_s": statistics.median(runs[den]["tokens_per_s"]),
        f"{prefix}_same_tokens": runs[num]["token_ids"] == runs[den]["token_ids"],
        f"{prefix}_nano_stats": runs[num]["stats"],
    }
