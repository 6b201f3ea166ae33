# SPDX-License-Identifier: Apache-2.0
"""Lamina benchmark (issue 4): per-layer round trip, wire bytes, decode throughput.

All ratios are against baselines measured in the same run:
- `rtt_us_shm` / `rtt_us_tcp`: median round trip of one decode layer's exchange (q, k, v out;
  attention output back; LLaMA-8B layer shape, batch 1) through the real client and server code,
  the server answering without computing (`--kernel none`): the transport round trip Lamina's
  33 us figure measures. Goal: <= 50 us on shm. The shm rings spin-then-block and both processes
  are pinned to their own cores. `rtt_full_us_*` is the same with vLLM's CPU kernel (what one layer
  costs end to end); `raw_pingpong_us_*` is an echo of the same bytes over the bare channel.
- `bytes_per_token_per_layer`: payload bytes of that exchange per token, checked against
  (2 + 2/G)·d·e of the paper.
- decode throughput and TBT at batch 32, context 512 (long enough that attention is a real share of
  the step) for plain vLLM, remote attention without overlap, with send-Q-early, and on the
  nano-batch executor with 2 nano-batches at pipeline depth n=1 (serial) and n=2 (ping-pong).
  `overlap_speedup` = send-Q-early / no overlap; `pipeline_speedup` = n=2 / n=1 (same runner,
  executor and RPCs; only the overlap differs). `decode_layer_split_ms` gives the attention side and
  the model side per layer, which bound what n=2 can gain. The engine runs in this process (vLLM
  binds its worker to core 0 with one thread), the attention server is pinned to core 1.

    python benchmarks/attn_bench.py --quick   # < 5 min, prints one JSON object; results/attn_bench_quick.*
    python benchmarks/attn_bench.py           # more batch sizes; writes results/attn_bench.{json,png}
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TOKEN = "attn-bench-token"
# A LLaMA-3-8B-shaped attention layer for the RTT (d = 4096, G = 4), float32 on this CPU box.
RTT_GEOM = dict(num_layers=1, num_heads=32, num_kv_heads=8, head_size=128, block_size=32,
                dtype="float32", max_num_tokens=256)
MEDIUM = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, vocab_size=1024)
# decode shape of the engine runs: Lamina's regime (large batch, long context), where attention is a
# real share of the step on this model
DECODE_BATCH, DECODE_CONTEXT = 32, 512
REMOTE_WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"
NANO_REMOTE_WORKER = "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"


# ------------------------------------------------------------------ round trips
SPIN_US = 100.0  # bounded spin-then-block on the shm rings (both sides pinned to their own core)
CLIENT_CPU, SERVER_CPU = 0, 1


def _pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of `pid` (threads spawned later inherit their creator's mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass


def _can_pin() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


def _echo_server(kind: str, reply_bytes: int, q, spin_us: float, cpu: int | None) -> None:
    """Raw ping-pong peer: answer every message with `reply_bytes` bytes (no attention)."""
    from vllm_disagg.transport import TransportOptions, get_transport

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    tr = get_transport(kind, TransportOptions(auth_token=TOKEN, spin_us=spin_us))
    lst = tr.listen_msg()
    q.put(lst.address)
    ch = lst.accept(timeout=30)
    reply = bytearray(reply_bytes)
    try:
        while True:
            msg = ch.recv(timeout=30)
            if msg.header == b"bye":
                return
            ch.send(b"r", [reply])
    finally:
        ch.close()
        lst.close()


def _decode_step(batch: int, context: int):
    import torch

    from vllm_disagg.attention.client import ClientMeta
    from vllm_disagg.attention.wire import StepMeta

    bs = RTT_GEOM["block_size"]
    cols = -(-(context + 1) // bs)
    table = (torch.arange(batch * cols, dtype=torch.int32) + 1).view(batch, cols)
    slots = torch.tensor([int(table[r, context // bs]) * bs + context % bs for r in range(batch)])
    step = StepMeta(torch.arange(batch + 1, dtype=torch.int32),
                    torch.full((batch,), context + 1, dtype=torch.int32), table, slots)
    return ClientMeta(step, max_query_len=1, num_actual_tokens=batch)


def start_servers(specs: dict[str, tuple[str, str, bool]]) -> dict:
    """Start attention server processes concurrently: name -> (transport, kernel, spin+pin).
    Spinning servers are pinned to SERVER_CPU (every thread; later ones inherit the mask)."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_disagg.attention.launcher import start_local_server

    def one(spec):
        kind, kernel, fast = spec
        extra = ("--kernel", kernel, *(("--spin-us", str(SPIN_US)) if fast else ()))
        srv = start_local_server(transport=kind, kv_cache_gib=1.0, env={"VLLM_DISAGG_AUTH_TOKEN": TOKEN},
                                 extra_args=extra)
        if fast and _can_pin():
            _pin(srv.proc.pid, {SERVER_CPU})
        return srv

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(one, spec) for name, spec in specs.items()}
    servers, errors = {}, []
    for name, fut in futures.items():
        try:
            servers[name] = fut.result()
        except Exception as err:  # stop the ones that did start, then fail
            errors.append(err)
    if errors:
        stop_servers(servers)
        raise errors[0]
    return servers


def stop_servers(servers: dict) -> None:
    for srv in servers.values():
        srv.stop()


def measure_rtt(srv, kind: str, iters: int, spin_us: float | None = SPIN_US, pin: bool = True,
                batch: int = 1, context: int = 32, geom: dict | None = None, raw: bool = True) -> dict:
    """Median round trip of `client.attend` for one decode layer against the server process `srv`.
    A `--kernel none` server runs its whole per-layer path (frame and metadata checks, metrics,
    reply) but no attention: the exchange's transport round trip (Lamina's figure); a `--kernel cpu`
    server gives the full per-layer round trip with vLLM's CPU kernel."""
    import torch

    from vllm_disagg.attention.client import DisaggAttentionClient

    g = geom or RTT_GEOM
    pin = pin and _can_pin()
    own_cpus = os.sched_getaffinity(0)
    try:
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        client = DisaggAttentionClient([srv.http], transport=kind, send_q_early=False, auth_token=TOKEN,
                                       spin_us=spin_us)
        client.connect(**g)
        meta = _decode_step(batch, context)
        q = torch.randn(batch, g["num_heads"], g["head_size"])
        k = torch.randn(batch, g["num_kv_heads"], g["head_size"])
        v = torch.randn_like(k)
        out = torch.empty_like(q)
        ch = client.conns[0].channel
        for _ in range(20):  # the first sends the step metadata; then warm caches and branch predictors
            client.attend(0, q, k, v, meta, 0.088, out)
        kernel0 = _server_layer_seconds(srv.http)
        sent0, recv0 = ch.stats.bytes_sent, ch.stats.bytes_received
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            client.attend(0, q, k, v, meta, 0.088, out)
            times.append(time.perf_counter() - t0)
        wire_bytes = (ch.stats.bytes_sent - sent0 + ch.stats.bytes_received - recv0) / iters
        kernel_s = (_server_layer_seconds(srv.http) - kernel0) / iters
        client.close()
    finally:
        os.sched_setaffinity(0, own_cpus)
    payload = sum(t.numel() * t.element_size() for t in (q, k, v, out))
    raw_us = (_raw_pingpong(kind, q.numel() * 4 + 2 * k.numel() * 4, out.numel() * 4, iters, spin_us, pin)
              if raw else None)
    med = statistics.median(times) * 1e6
    return {"rtt_us": med, "rtt_p90_us": _pct(times, 0.9) * 1e6, "server_kernel_us": kernel_s * 1e6,
            "rtt_minus_kernel_us": med - kernel_s * 1e6, "raw_pingpong_us": raw_us, "payload_bytes": payload,
            "wire_bytes": wire_bytes, "batch": batch, "context": context, "spin_us": spin_us, "pinned": pin}


def _server_layer_seconds(http: str) -> float:
    """Total server-side compute seconds (all calls so far), from its Prometheus histogram."""
    import urllib.request

    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:disagg_attention_layer_seconds_sum"))


def _raw_pingpong(kind: str, send_bytes: int, reply_bytes: int, iters: int, spin_us: float | None = None,
                  pin: bool = False) -> float:
    from vllm_disagg.transport import TransportOptions, get_transport

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    opts = TransportOptions(auth_token=TOKEN, **({} if spin_us is None else {"spin_us": spin_us}))
    proc = ctx.Process(target=_echo_server, args=(kind, reply_bytes, q, opts.spin_us, SERVER_CPU if pin else None),
                       daemon=True)
    proc.start()
    own_cpus = os.sched_getaffinity(0)
    try:
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        ch = get_transport(kind, opts).connect_msg(q.get(timeout=60), timeout=10)
        payload = bytearray(send_bytes)
        for _ in range(20):
            ch.send(b"p", [payload])
            ch.recv(timeout=10)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            ch.send(b"p", [payload])
            ch.recv(timeout=10)
            times.append(time.perf_counter() - t0)
        ch.send(b"bye", [])
        ch.close()
        return statistics.median(times) * 1e6
    finally:
        os.sched_setaffinity(0, own_cpus)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


# ------------------------------------------------------------------ engine decode
def open_engine(model_dir: str, batch: int, context: int, max_tokens: int, **extra):
    from vllm import LLM

    from vllm_disagg.testing import tiny_llm_kwargs

    # the whole batch prefills in one step, so the first-to-last-token window holds only decode steps
    return LLM(**tiny_llm_kwargs(model_dir, max_num_batched_tokens=max(4096, batch * context), max_num_seqs=64,
                                 disable_log_stats=False, max_model_len=context + max_tokens + 64, **extra))


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def decode_once(llm, batch: int, context: int, max_tokens: int) -> dict:
    """Decode tokens/s and TBT from the engine's own per-request timestamps (first and last token);
    the prefill step is excluded."""
    from vllm_disagg.testing import token_prompts

    prompts = token_prompts(batch, context, vocab=MEDIUM["vocab_size"], seed=batch)
    outs = _generate(llm, prompts, max_tokens)
    first = min(o.metrics.first_token_ts for o in outs)
    window = max(max(o.metrics.last_token_ts for o in outs) - first, 1e-9)
    steps = max_tokens - 1
    return {"decode_tokens_per_s": batch * steps / window, "tbt_ms": window / steps * 1e3,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def _generate(llm, prompts: list, n: int) -> list:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate(prompts, sp, use_tqdm=False)


def engine_configs(servers: list[str]) -> dict[str, dict]:
    """plain vLLM; stock remote runner (no overlap, send-Q-early off/on); and the nano-batch
    executor with 2 nano-batches at pipeline depth 1 (serial: one batch in flight) and 2 (ping-pong),
    so `pipeline_speedup` compares n=2 with n=1 on the same runner, executor and RPC count.
    Each waits for replies its best way: without overlap the model worker's core has nothing else
    to do, so the client spins on the ring (SPIN_US) before sleeping; at n=2 the waiting "net"
    thread shares that core (and the GIL) with the dense thread, so it sleeps at once."""
    def remote(early: bool, pipeline: int | None = None) -> dict:
        ra = {"servers": servers, "partition": "head", "send_q_early": early,
              "spin_us": 0.0 if pipeline == 2 else SPIN_US}
        cfg = {"disagg": {"remote_attention": ra}}
        if pipeline is None:
            return {"worker_cls": REMOTE_WORKER, "additional_config": cfg}
        ra["pipeline"] = pipeline
        cfg["disagg"]["nanoflow"] = {"nano_batches": 2}
        return {"worker_cls": NANO_REMOTE_WORKER, "additional_config": cfg}

    return {"plain": {}, "remote": remote(False), "remote_send_q_early": remote(True),
            "remote_pipeline_n1": remote(False, 1), "remote_pipeline_n2": remote(False, 2)}


def run_engines(batches: list[int], context: int, max_tokens: int, reps: int, only: list[str] | None = None,
                server=None) -> dict:
    """All engines live in this process at once (in-process engine cores) and are timed in turn,
    `reps` rounds (A B C A B C ...), so load changes on a shared box hit every config alike.
    Interference only ever slows a run down, so each config's figure is its best round (`*_rounds`
    keeps them all). The attention server is pinned to core 1 and spins briefly for the next layer
    before sleeping; this process is confined to CLIENT_CPU while the engines exist (vLLM's worker
    and the nano-batch units take their cores, one OpenMP thread, from it), so the model side and
    the attention side each own a core. The remote engines share the server one at a time (each
    run prefills its own requests; nothing of another run is read)."""
    from vllm_disagg.testing import make_tiny_llama

    model_dir = str(make_tiny_llama(tempfile.mkdtemp(prefix="attn-bench-"), **MEDIUM))
    own = server is None
    srv = start_servers({"engine": ("shm", "cpu", True)})["engine"] if own else server
    engines: dict = {}
    own_cpus = os.sched_getaffinity(0)
    try:
        if _can_pin():  # the model side on CLIENT_CPU only: the nano-batch units take their cores from here
            os.sched_setaffinity(0, {CLIENT_CPU})
        for name, extra in engine_configs([srv.http]).items():
            if not only or name in only:
                engines[name] = open_engine(model_dir, max(batches), context, max_tokens, **extra)
        results = {name: [{"batch": b, "context": context, "rounds": []} for b in batches] for name in engines}
        for i, batch in enumerate(batches):
            for llm in engines.values():
                _generate(llm, [{"prompt_token_ids": [5] * 8}], 2)  # warm-up
            for _ in range(reps):
                for name, llm in engines.items():
                    results[name][i]["rounds"].append(decode_once(llm, batch, context, max_tokens))
        for rs in results.values():
            for r in rs:
                rounds = r.pop("rounds")
                r["decode_tokens_per_s_rounds"] = [x["decode_tokens_per_s"] for x in rounds]
                r["decode_tokens_per_s"] = max(r["decode_tokens_per_s_rounds"])
                r["tbt_ms"] = min(x["tbt_ms"] for x in rounds)
                r["token_ids"] = rounds[-1]["token_ids"]
                r["same_tokens_every_round"] = all(x["token_ids"] == r["token_ids"] for x in rounds)
        for name, llm in engines.items():
            if "remote_pipeline" in name:  # which units/cores the nano-batch executor ran on
                results[name][-1]["nanoflow_units"] = llm.collective_rpc("nanoflow_stats")[0].get("units")
        for name, rs in results.items():
            print(f"[attn_bench] {name}: " + ", ".join(
                f"B={r['batch']} {r['decode_tokens_per_s']:.0f} tok/s" for r in rs), file=sys.stderr)
    finally:
        for llm in engines.values():
            close_engine(llm)
        os.sched_setaffinity(0, own_cpus)
        if own:
            srv.stop()
    return results


def speedup(eng: dict, at: int, num: str, den: str) -> float:
    """num/den decode throughput, each at its best round (load only ever slows a run down)."""
    return eng[num][at]["decode_tokens_per_s"] / eng[den][at]["decode_tokens_per_s"]


def paired_speedup(eng: dict, at: int, num: str, den: str) -> float:
    """Median over rounds of num/den decode throughput (same round = similar load)."""
    a, b = eng[num][at]["decode_tokens_per_s_rounds"], eng[den][at]["decode_tokens_per_s_rounds"]
    return statistics.median(x / y for x, y in zip(a, b))


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="< 5 min, batch 32 only, one repetition")
    args = ap.parse_args()
    os.environ["VLLM_DISAGG_AUTH_TOKEN"] = TOKEN  # the engines' clients must present the servers' token
    from vllm_disagg.testing import apply_test_env

    apply_test_env(in_process=True)
    iters = 2000 if args.quick else 5000
    specs = {"none_shm": ("shm", "none", True), "none_tcp": ("tcp", "none", True), "cpu_shm": ("shm", "cpu", True)}
    if not args.quick:
        specs.update(cpu_tcp=("tcp", "cpu", True), cpu_shm_default=("shm", "cpu", False))
    servers = start_servers(specs)
    try:
        transport = {kind: measure_rtt(servers[f"none_{kind}"], kind, iters) for kind in ("shm", "tcp")}
        full = {"shm": measure_rtt(servers["cpu_shm"], "shm", iters, raw=False)}
        if not args.quick:
            full["tcp"] = measure_rtt(servers["cpu_tcp"], "tcp", iters, raw=False)
            full["shm_default"] = measure_rtt(servers["cpu_shm_default"], "shm", iters, spin_us=None, pin=False)
        half = measure_half_batch(servers["cpu_shm"], iters=100 if args.quick else 500)
        batches = [DECODE_BATCH] if args.quick else [1, 8, 16, 32]
        eng = run_engines(batches, DECODE_CONTEXT, max_tokens=10 if args.quick else 24, reps=3 if args.quick else 5,
                          server=servers["cpu_shm"])
    finally:
        stop_servers(servers)
    g = RTT_GEOM
    d, group, e = g["num_heads"] * g["head_size"], g["num_heads"] // g["num_kv_heads"], 4
    formula = (2 + 2 / group) * d * e
    at = batches.index(DECODE_BATCH)
    split = decode_layer_split(eng, at, half)

    def tput(name: str) -> float:
        return eng[name][at]["decode_tokens_per_s"]

    same = {n: all(r["same_tokens_every_round"] for r in eng[n])
            and [r["token_ids"] for r in eng[n]] == [r["token_ids"] for r in eng["plain"]] for n in eng}
    out = {
        "rtt_us_shm": round(transport["shm"]["rtt_us"], 1),
        "rtt_us_tcp": round(transport["tcp"]["rtt_us"], 1),
        "rtt_definition": "median client.attend() round trip of one decode layer (LLaMA-8B layer shape, batch 1: "
                          "q,k,v out, attention output back) through the real client and server code (framing, "
                          "checks, auth'd channel, metrics) with the server answering without computing "
                          f"(--kernel none); shm rings spin {SPIN_US:.0f} us then block; client and server "
                          "pinned to their own cores. rtt_full_* adds vLLM's CPU attention kernel.",
        "raw_pingpong_us_shm": round(transport["shm"]["raw_pingpong_us"], 1),
        "raw_pingpong_us_tcp": round(transport["tcp"]["raw_pingpong_us"], 1),
        "rtt_full_us_shm": round(full["shm"]["rtt_us"], 1),
        "rtt_full_us_tcp": round(full["tcp"]["rtt_us"], 1) if "tcp" in full else None,
        "server_kernel_us_shm": round(full["shm"]["server_kernel_us"], 1),
        "rtt_full_us_shm_unpinned_no_spin": round(full["shm_default"]["rtt_us"], 1) if "shm_default" in full else None,
        "bytes_per_token_per_layer": transport["shm"]["payload_bytes"] / transport["shm"]["batch"],
        "bytes_per_token_per_layer_formula": formula,
        "wire_bytes_per_layer_incl_framing": transport["shm"]["wire_bytes"],
        "overlap_speedup": round(speedup(eng, at, "remote_send_q_early", "remote"), 3),
        "pipeline_speedup": round(speedup(eng, at, "remote_pipeline_n2", "remote_pipeline_n1"), 3),
        "pipeline_speedup_paired_median": round(paired_speedup(eng, at, "remote_pipeline_n2", "remote_pipeline_n1"), 3),
        "pipeline_definition": f"decode tokens/s at batch {DECODE_BATCH}, context {DECODE_CONTEXT}: n=2 (ping-pong, "
                               "2 nano-batches, attention RPC on the net unit) over n=1 (the same 2 nano-batches and "
                               "RPCs, serial), same runner/executor, engines alive together and timed in turn, each "
                               "at its best round; engine on core 0 (1 thread), server on core 1",
        "pipeline_n2_vs_stock_remote": round(speedup(eng, at, "remote_pipeline_n2", "remote"), 3),
        "remote_vs_plain": round(speedup(eng, at, "remote", "plain"), 3),
        "decode_layer_split_ms": split,
        f"decode_tokens_per_s_at_{DECODE_BATCH}": {n: round(tput(n), 1) for n in eng},
        f"tbt_ms_at_{DECODE_BATCH}": {n: round(eng[n][at]["tbt_ms"], 2) for n in eng},
        "greedy_tokens_identical_to_plain": same,
        "geometry_rtt": g, "model": MEDIUM, "decode_context": DECODE_CONTEXT, "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    rtt = {"shm": transport["shm"], "tcp": transport["tcp"], **{f"full_{k}": v for k, v in full.items()}}
    full_out = {**out, "rtt": rtt, "engines": {n: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]
                                                for n, rs in eng.items()}}
    stem = "attn_bench_quick" if args.quick else "attn_bench"
    (RESULTS / f"{stem}.json").write_text(json.dumps(full_out, indent=1))
    _plot(full_out, batches, RESULTS / f"{stem}.png")
    print(json.dumps(out))
    return 0


def measure_half_batch(srv, iters: int) -> dict:
    """One nano-batch's decode attention exchange at the engine runs' shape (half of DECODE_BATCH at
    DECODE_CONTEXT, the medium model's layer), through the real client and server."""
    m = MEDIUM
    geom = dict(num_layers=1, num_heads=m["num_attention_heads"], num_kv_heads=m["num_key_value_heads"],
                head_size=m["head_dim"], block_size=RTT_GEOM["block_size"], dtype="float32",
                max_num_tokens=DECODE_BATCH)
    return measure_rtt(srv, "shm", iters, batch=DECODE_BATCH // 2, context=DECODE_CONTEXT, geom=geom, raw=False)


def decode_layer_split(eng: dict, at: int, half: dict) -> dict:
    """Explains pipeline_speedup: per layer of one decode step, the attention side (the server's
    kernel for both nano-batches, and the two round trips that include it) and the model side
    (n=1's step time per layer minus those round trips: dense ops, norms, the sampling share and
    the client's Python). With both sides on their own cores, n=2 can at best hide the smaller."""
    attn_ms = 2 * half["server_kernel_us"] / 1e3
    rtt_ms = 2 * half["rtt_us"] / 1e3
    step_n1 = eng["remote_pipeline_n1"][at]["tbt_ms"]
    model_ms = step_n1 / MEDIUM["num_hidden_layers"] - rtt_ms
    return {"attention_server_kernel": round(attn_ms, 3), "attention_round_trips": round(rtt_ms, 3),
            "model_side": round(model_ms, 3), "n1_step": round(step_n1, 3),
            "n2_step": round(eng["remote_pipeline_n2"][at]["tbt_ms"], 3),
            "ideal_n2_speedup": round((model_ms + rtt_ms) / max(model_ms, rtt_ms, 1e-9), 3)}


def _plot(full: dict, batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rs in full["engines"].items():
        a.plot(batches, [r["decode_tokens_per_s"] for r in rs], marker="o", label=name)
    a.set_xlabel("batch size")
    a.set_ylabel("decode tokens/s")
    a.set_title("decode throughput (CPU, medium random Llama)")
    a.legend()
    kinds = ["shm", "tcp"]
    xs = range(len(kinds))
    b.bar([x - 0.27 for x in xs], [full["rtt"][k]["raw_pingpong_us"] for k in kinds], 0.27, label="raw ping-pong")
    b.bar(list(xs), [full["rtt"][k]["rtt_us"] for k in kinds], 0.27, label="layer exchange, no kernel")
    b.bar([x + 0.27 for x in xs], [full["rtt"].get("full_" + k, {}).get("rtt_us", 0.0) for k in kinds], 0.27,
          label="layer exchange + CPU kernel")
    b.axhline(50, color="gray", ls="--", label="goal 50 us")
    b.set_xticks(list(xs), kinds)
    b.set_ylabel("microseconds (median)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
