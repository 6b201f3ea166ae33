# SPDX-License-Identifier: Apache-2.0
"""Remote attention against plain vLLM on the same two cores, decode at one batch and context.

Every engine prefills the same `batch` requests once, then the engines take turns of a few decode
steps, each step timed through `engine.step()` (vLLM's own loop), so load changes hit all alike.
The engines run in this process (in-process engine core: scheduler, worker and output processing on
one thread, no API server); each turn places this process's threads first:
- plain vLLM, the same engine in two placements: `plain_default` = vLLM's default binding on this
  box (one OpenMP thread on core 0; core 1 is the reserved core, where the API server and EngineCore
  of a `vllm serve` would sit) and `plain_bind_0_1` = VLLM_CPU_OMP_THREADS_BIND=0-1 (two OpenMP
  threads over both cores, the scheduler sharing core 0). "Plain on both cores" is, per turn, the
  faster of the two;
- remote attention: the model worker on core 0 (one thread), its attention server on core 1 (one
  thread, spinning briefly for the next message). `lamina_n2`: 2 nano-batches in flight (ping-pong on
  the nano-batch executor); `lamina_n1`: the same nano-batches serially (the old baseline);
  `remote_default`: the stock remote runner with the defaults (send_q_early "auto", off here; the
  transport's own spin, none on <= 2 CPUs); `lamina_auto`: the composed worker's defaults (depth 2,
  num_nano_batches auto);
  `remote_send_q_early_off` / `_on`: the same with send-Q-early set explicitly.
Paired figures are medians over turns of the per-turn ratio.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from bench_probes import (
    BOTH_CORES,
    MODEL_CORE,
    Probes,
    median_ratio,
    per_step_breakdown,
    placed,
    runner_of,
    server_seconds,
)
from bench_probes import probes as get_probes

REMOTE_WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"
NANO_REMOTE_WORKER = "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"
PLAIN_PLACEMENTS = {"plain_default": ({MODEL_CORE}, 1), "plain_bind_0_1": (BOTH_CORES, 2)}
REMOTE_PLACEMENT = ({MODEL_CORE}, 1)
PIPELINED = ("lamina_n2", "lamina_auto")
SPIN_US = 100.0


def remote_config(server: str, kind: str) -> dict:
    """Engine arguments of one remote configuration (see the module docstring)."""
    ra: dict = {"servers": [server]}
    if kind == "lamina_auto":  # the composed worker's defaults: depth 2, num_nano_batches auto
        return {"worker_cls": NANO_REMOTE_WORKER, "additional_config": {"disagg": {
            "remote_attention": ra, "nanoflow": {"num_nano_batches": "auto"}}}}
    if kind in ("lamina_n2", "lamina_n1"):
        ra.update(pipeline=2 if kind == "lamina_n2" else 1, spin_us=0.0 if kind == "lamina_n2" else SPIN_US)
        return {"worker_cls": NANO_REMOTE_WORKER,
                "additional_config": {"disagg": {"remote_attention": ra, "nanoflow": {"num_nano_batches": 2}}}}
    if kind != "remote_default":  # the default: the transport's own spin (none on <= 2 CPUs)
        ra["send_q_early"] = kind == "remote_send_q_early_on"
    return {"worker_cls": REMOTE_WORKER, "additional_config": {"disagg": {"remote_attention": ra}}}


class Engine:
    """One engine of the run: its LLM, requests, latest outputs, server and per-turn step times."""

    def __init__(self, name: str, llm, server=None, placements: dict | None = None):
        self.name, self.llm, self.server = name, llm, server
        self.placements = placements or {name: REMOTE_PLACEMENT}
        self.ids: list[str] = []
        self.outs: dict = {}
        self.turns: dict[str, list[list[float]]] = {p: [] for p in self.placements}
        self.server_s: dict[str, list[float]] = {p: [0.0, 0.0] for p in self.placements}  # kernel, busy

    def step(self) -> float:
        t0 = time.perf_counter()
        for o in self.llm.llm_engine.step():
            self.outs[o.request_id] = o
        return time.perf_counter() - t0


def open_engine(model_dir: str, batch: int, context: int, max_tokens: int, **extra):
    from vllm import LLM

    from vllm_disagg.testing import tiny_llm_kwargs

    # vLLM's default CPU block size (128), not the tests' 32: what a user runs
    return LLM(**tiny_llm_kwargs(model_dir, block_size=128, max_num_batched_tokens=16384,
                                 max_num_seqs=max(64, batch), disable_log_stats=False,
                                 max_model_len=context + max_tokens + 64, **extra))


def close_engine(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_equal_cores(model_dir: str, batch: int, context: int, kinds: list[str], servers: dict,
                    steps_per_turn: int, turns: int, vocab: int, warm_steps: int = 2) -> dict:
    """Prefill once per engine, then `turns` rounds of turns; returns per placement its step times,
    tokens, breakdown; `kinds`: remote configurations (each with its own server in `servers`)."""
    from vllm import SamplingParams

    from vllm_disagg.testing import token_prompts

    probes = get_probes()
    prompts = token_prompts(batch, context, vocab=vocab, seed=batch + context)
    max_tokens = 1 + warm_steps + len(PLAIN_PLACEMENTS) * steps_per_turn * turns + 8
    engines: dict[str, Engine] = {}
    try:
        with placed(BOTH_CORES, 2):
            engines["plain"] = Engine("plain", open_engine(model_dir, batch, context, max_tokens),
                                      placements=PLAIN_PLACEMENTS)
        for kind in kinds:
            with placed(*REMOTE_PLACEMENT):
                llm = open_engine(model_dir, batch, context, max_tokens, **remote_config(servers[kind].http, kind))
            engines[kind] = Engine(kind, llm, servers[kind])
        for e in engines.values():
            probes.watch_runner(runner_of(e.llm))
            probes.engine = f"{e.name}:prefill"
            with placed(*(REMOTE_PLACEMENT if e.server else (BOTH_CORES, 2))):
                sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                e.ids = [f"{e.name}-{i}" for i in range(batch)]
                for rid, p in zip(e.ids, prompts):
                    e.llm.llm_engine.add_request(rid, p, sp)
                while not all(rid in e.outs for rid in e.ids):
                    e.step()
                for _ in range(warm_steps):
                    e.step()
        for _ in range(turns):
            for e in engines.values():
                for placement, (cpus, threads) in e.placements.items():
                    probes.engine = placement
                    before = server_seconds(e.server.http) if e.server else (0.0, 0.0)
                    with placed(cpus, threads):
                        e.turns[placement].append([e.step() * 1e3 for _ in range(steps_per_turn)])
                    if e.server:
                        after = server_seconds(e.server.http)
                        for i in (0, 1):
                            e.server_s[placement][i] += after[i] - before[i]
        tokens = {}
        for e in engines.values():
            probes.engine = f"{e.name}:finish"
            with placed(*next(iter(e.placements.values()))):
                while e.llm.llm_engine.has_unfinished_requests():
                    e.step()
            tokens[e.name] = [list(e.outs[rid].outputs[0].token_ids) for rid in e.ids]
            if e.name in PIPELINED:
                tokens["lamina_n2_stats"] = e.llm.collective_rpc("nanoflow_stats")[0]
            if e.name == "remote_default":  # what the default resolved to, as the client runs it
                tokens["remote_default_send_q_early"] = attention_client(e.llm).send_q_early
    finally:
        for e in engines.values():
            close_engine(e.llm)
    return summarize(engines, probes, tokens, batch, context)


def summarize(engines: dict[str, Engine], probes: Probes, tokens: dict, batch: int, context: int) -> dict:
    steps = {p: [t for turn in e.turns[p] for t in turn] for e in engines.values() for p in e.placements}
    turn_median = {p: [statistics.median(t) for t in e.turns[p]] for e in engines.values() for p in e.placements}
    server_s = {p: e.server_s[p] for e in engines.values() if e.server for p in e.placements}
    both = [min(a, b) for a, b in zip(turn_median["plain_default"], turn_median["plain_bind_0_1"])]
    turn_median["plain_both_cores"] = both
    out: dict = {"batch": batch, "context": context, "configs": {}}
    for p, ts in steps.items():
        out["configs"][p] = {
            "tbt_ms": round(statistics.median(ts), 3),
            "decode_tokens_per_s": round(batch / statistics.median(ts) * 1e3, 1),
            "turn_median_tbt_ms": [round(x, 3) for x in turn_median[p]],
            "breakdown_ms": per_step_breakdown(probes.totals[p], len(ts), statistics.fmean(ts), server_s.get(p),
                                               p in PIPELINED),
            "timed_steps": len(ts),
        }
    out["plain_both_cores_turn_median_tbt_ms"] = [round(x, 3) for x in both]
    out["plain_binding_wins"] = {
        "plain_default": sum(a <= b for a, b in zip(turn_median["plain_default"], turn_median["plain_bind_0_1"])),
        "plain_bind_0_1": sum(b < a for a, b in zip(turn_median["plain_default"], turn_median["plain_bind_0_1"]))}
    out["faster_plain_binding"] = min(("plain_default", "plain_bind_0_1"),
                                      key=lambda p: statistics.median(turn_median[p]))
    out["paired"] = {p: round(median_ratio(both, turn_median[p]), 3) for p in turn_median if p not in PLAIN_PLACEMENTS}
    ref = tokens["plain"]
    out["greedy_tokens_identical_to_plain"] = {k: v == ref for k, v in tokens.items()
                                               if isinstance(v, list) and k != "plain"}
    out["lamina_n2_nanoflow_stats"] = {k: v for k, v in (tokens.get("lamina_n2_stats") or {}).items()
                                       if k in ("pipeline_steps", "split_attention_steps", "plain_steps", "steps")}
    out["remote_default_send_q_early"] = tokens.get("remote_default_send_q_early")
    out["turn_medians"] = {p: [round(x, 3) for x in v] for p, v in turn_median.items()}
    for p, r in out["configs"].items():
        print(f"[attn_bench] B={batch} ctx={context} {p}: {r['decode_tokens_per_s']:.0f} tok/s "
              f"(tbt {r['tbt_ms']:.1f} ms) {r['breakdown_ms']}", file=sys.stderr)
    return out


def attention_client(llm):
    """The remote attention client an engine's attention layers use."""
    for module in runner_of(llm).model.modules():
        client = getattr(getattr(module, "impl", None), "_client", None)
        if client is not None:
            return client
    raise RuntimeError("no remote attention client in this engine")


def paired(result: dict, num: str, den: str) -> float:
    """Median over turns of den/num step time = num/den throughput."""
    tm = result["turn_medians"]
    return round(median_ratio(tm[den], tm[num]), 3)


def make_model(layers: int, shape: dict) -> str:
    from vllm_disagg.testing import make_tiny_llama

    return str(make_tiny_llama(tempfile.mkdtemp(prefix="attn-bench-"), weights=True,
                               **{**shape, "num_hidden_layers": layers}))
