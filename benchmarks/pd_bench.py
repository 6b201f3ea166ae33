# SPDX-License-Identifier: Apache-2.0
"""Splitwise P/D benchmark (issue 3): push throughput, exposed KV transfer, TTFT vs NIXL, mixed load.

All in one run, on real `vllm serve` processes on 127.0.0.1 (a SmolLM2-135M-shaped Llama with dummy
weights: 30 layers, the real compute, no download):
1. KV push bandwidth over tcp vs raw loopback TCP (reuses benchmarks/transport_bench.py).
2. Exposed KV transfer (part of the push after prefill ended, from P's `vllm:disagg_kv_*` metrics)
   as a fraction of P's prefill time (`vllm:request_prefill_time_seconds`), layer-wise vs serialized.
3. TTFT of our 1P+1D (router, push) vs vLLM's NixlConnector 1P+1D (toy-proxy pull flow), same prompts.
   `handoff_s` = TTFT minus the P request's latency (for NIXL: D's first token after P answered).
4. Mixed load (Poisson long prompts + closed-loop decodes): P99 TBT/TTFT and output tokens/s of
   1P+1D (one core each) vs one colocated plain instance on the same two cores (1 and 2 threads).

    python benchmarks/pd_bench.py --quick   # one JSON object on stdout (goal keys at top level)
    python benchmarks/pd_bench.py           # + results/pd_bench.json, pd_bench.png, pd_profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
from vllm_disagg.launch.local import InstanceSpec, LocalCluster, free_ports  # noqa: E402
from vllm_disagg.router.config import RouterConfig  # noqa: E402
from vllm_disagg.router.policy import SchedulerConfig  # noqa: E402
from vllm_disagg.router.server import Router, RouterServer  # noqa: E402
from vllm_disagg.testing import make_tiny_llama  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                     torch_dtype="bfloat16", max_position_embeddings=8192)
VLLM_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
             "--max-model-len", "4096", "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
             "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(384 << 20)]  # 17k tokens each
# num_threads=1: NIXL's default 4 UCX threads spin on this 2-core box and starve the engines.
NIXL_CFG = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_connector_extra_config": {"num_threads": 1}}
NIXL_P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def log(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- deployment
def pd_specs(quick: bool) -> list[InstanceSpec]:
    """Our 1P+1D (P layer-wise at every size; full run adds a serialized-only P): P core 0, D core 1."""
    ports = iter(free_ports(6))
    specs = [InstanceSpec("prefill", 0, next(ports), next(ports), "0", {"layerwise_threshold_tokens": 0}),
             InstanceSpec("decode", 0, next(ports), next(ports), "1")]
    if not quick:
        specs.append(InstanceSpec("prefill", 1, next(ports), next(ports), "0",
                                  {"layerwise_threshold_tokens": 1 << 30}))
    return specs


def nixl_specs() -> list[InstanceSpec]:
    """vLLM's NixlConnector 1P+1D (UCX over shm/loopback), one core each.

    P gets the *last* core: on CPU the NIXL worker pins its calling thread to the last core of the NUMA
    node (hooks notes §5); with P's OpenMP on core 0 that thread fought D for core 1 and P's prefill ran
    ~10x slower. Binding P to the last core keeps NIXL's pin and P's compute together."""
    ports = iter(free_ports(4))
    specs = []
    for i, (role, core) in enumerate((("kv_producer", "1"), ("kv_consumer", "0"))):
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(next(ports)),
               "UCX_NET_DEVICES": "lo"}
        specs.append(InstanceSpec("mixed", i, next(ports), None, core, env=env,
                                  args=["--kv-transfer-config", json.dumps({**NIXL_CFG, "kv_role": role})]))
    return specs


def colocated_specs(cores: str) -> list[InstanceSpec]:
    return [InstanceSpec("mixed", 0, free_ports(1)[0], None, cores)]


@contextlib.asynccontextmanager
async def phase(name: str, specs: list[InstanceSpec], model_dir: Path, log_dir: Path):
    """One set of servers at a time: this box has 2 cores and a shared NUMA node."""
    cluster = LocalCluster(specs, str(model_dir), "tcp", VLLM_ARGS, kv_cache_gib=None, log_dir=log_dir / name)
    try:
        cluster.start()
        await cluster.wait_healthy(420)  # a server whose side channel lost a port race never gets healthy
        log(f"phase {name}: {len(specs)} instance(s) healthy")
        yield cluster.specs
    finally:
        await asyncio.to_thread(cluster.stop)


async def start_router(p: InstanceSpec, d: InstanceSpec) -> RouterServer:
    cfg = RouterConfig(prefill_urls=[p.url], prefill_kv=[p.kv_addr], decode_urls=[d.url], read_timeout_s=600)
    server = RouterServer(Router(cfg, SchedulerConfig(None, None)), "127.0.0.1", 0)
    await server.start()
    return server


# ------------------------------------------------------------------ clients
def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


async def stream(session, url: str, body: dict, path: str = "/v1/completions") -> dict:
    """Send one streaming completion; token arrival times relative to the send."""
    t0 = time.perf_counter()
    times: list[float] = []
    body = {"temperature": 0, "ignore_eos": True, "stream": True, **body}
    async with session.post(f"{url}{path}", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"{url}: {event['error']}")
                if event["choices"] and event["choices"][0].get("text") is not None:
                    times.append(time.perf_counter() - t0)
    return {"t0": t0, "times": times}


async def nixl_request(session, p_url: str, d_url: str, body: dict) -> dict:
    """vLLM's toy-proxy pull flow: P first (max_tokens=1), then D with P's kv_transfer_params."""
    t0 = time.perf_counter()
    p_body = {**body, "max_tokens": 1, "stream": False, "temperature": 0, "kv_transfer_params": NIXL_P_PARAMS}
    async with session.post(f"{p_url}/v1/completions", json=p_body) as resp:
        params = (await resp.json())["kv_transfer_params"]
    t_p = time.perf_counter() - t0
    out = await stream(session, d_url, {**body, "kv_transfer_params": params})
    return {"ttft": t_p + out["times"][0], "p_latency": t_p, "times": out["times"]}


async def metrics(session, url: str) -> dict[str, float]:
    """Sum of every sample per name (labels folded) from a /metrics page."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# --------------------------------------------------------------- measurements
async def exposed_fraction(session, router_url: str, p_url: str, n_tokens: int, reps: int) -> dict:
    """Exposed push time / prefill time on P, over `reps` sequential requests."""
    rng = random.Random(n_tokens)
    before = await metrics(session, p_url)
    ttfts = []
    for _ in range(reps):
        out = await stream(session, router_url, {"prompt": prompt(n_tokens, rng), "max_tokens": 2})
        ttfts.append(out["times"][0])
    await asyncio.sleep(1.5)  # stats reach the frontend with the next engine step / logging interval
    after = await metrics(session, p_url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    exposed = delta.get("vllm:disagg_kv_exposed_transfer_seconds_sum", float("nan"))
    prefill = delta.get("vllm:request_prefill_time_seconds_sum", float("nan"))
    pushes = delta.get("vllm:disagg_kv_exposed_transfer_seconds_count", 0.0)
    return {"num_tokens": n_tokens, "reps": reps, "pushes": pushes, "exposed_s": exposed, "prefill_s": prefill,
            "exposed_fraction": exposed / prefill if prefill else None,
            "transfer_s_per_req": delta.get("vllm:disagg_kv_request_transfer_seconds_sum", 0) / max(pushes, 1),
            "prefill_s_per_req": prefill / reps, "ttft_s_median": statistics.median(ttfts), "ttft_s": ttfts}


async def ttft_nixl(session, p_url: str, d_url: str, n_tokens: int, reps: int) -> dict:
    rng = random.Random(n_tokens)  # the same prompts as exposed_fraction (our TTFTs come from there)
    outs = [await nixl_request(session, p_url, d_url, {"prompt": prompt(n_tokens, rng), "max_tokens": 2})
            for _ in range(reps)]
    return {"ttft": [o["ttft"] for o in outs], "handoff": [o["ttft"] - o["p_latency"] for o in outs]}


async def mixed_load(session, url: str, duration_s: float, rate: float, long_tokens: int,
                     num_decoders: int, seed: int = 0) -> dict:
    """Poisson arrivals of long prompts plus closed-loop decode streams; TBT/TTFT/throughput."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    prompts = [prompt(long_tokens, rng) for _ in arrivals]
    start = time.perf_counter()
    results: list[tuple[str, dict]] = []

    async def long_req(at: float, p: list[int]) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        results.append(("long", await stream(session, url, {"prompt": p, "max_tokens": 16})))

    async def decoder(i: int) -> None:
        r = random.Random(seed * 100 + i)
        while time.perf_counter() - start < duration_s:
            results.append(("decode", await stream(session, url, {"prompt": prompt(64, r), "max_tokens": 64})))

    await asyncio.gather(*(long_req(a, p) for a, p in zip(arrivals, prompts, strict=True)),
                         *(decoder(i) for i in range(num_decoders)))
    wall = time.perf_counter() - start
    gaps = [[b - a for a, b in zip(r["times"], r["times"][1:])] for _, r in results]
    tbt = [g for req in gaps for g in req]
    worst = [max(req) for req in gaps if req]  # one stall per request: P99 over requests shows prefill hiccups
    ttft = [r["times"][0] for kind, r in results if kind == "long"]
    tokens = sum(len(r["times"]) for _, r in results)
    return {"num_long": len(ttft), "num_requests": len(results), "wall_s": wall, "tokens_per_s": tokens / wall,
            "p99_tbt_s": _pct(tbt, 99), "p50_tbt_s": _pct(tbt, 50), "p999_tbt_s": _pct(tbt, 99.9),
            "p99_request_max_tbt_s": _pct(worst, 99), "p99_ttft_s": _pct(ttft, 99),
            "p50_ttft_s": _pct(ttft, 50)}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def push_vs_loopback(quick: bool) -> dict:
    """tcp KV push vs raw loopback TCP, interleaved rounds (shared noisy box), medians; the
    contenders are benchmarks/transport_bench.py's own (`RawTcp`, `KVPush`)."""
    import transport_bench as tb

    nbytes, repeats = (32 << 20, 5) if quick else (64 << 20, 11)
    raw, push = tb.RawTcp(nbytes, repeats), tb.KVPush("tcp", nbytes, num_streams=2)
    times: dict[str, list[float]] = {"raw": [], "tcp": []}
    try:
        for rep in range(repeats):
            times["raw"].append(raw.bw_once(rep))
            times["tcp"].append(push.bw_once(rep))
    finally:
        push.close()
        raw.close()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"raw_tcp_gbps": gbps["raw"], "tcp_push_gbps": gbps["tcp"], "ratio": gbps["tcp"] / gbps["raw"],
            "bytes": nbytes, "repeats": repeats}


# ------------------------------------------------------------------- main
async def run(quick: bool, model_dir: Path, log_dir: Path) -> dict:
    out: dict = {"quick": quick, "model": "SmolLM2-135M shape, dummy weights, bf16", "load1_start": os.getloadavg()[0]}
    out["push"] = await asyncio.to_thread(push_vs_loopback, quick)
    log(f"push {out['push']}")
    sizes, reps = ([1024], 3) if quick else ([128, 512, 1024, 2048], 5)
    ttft_sizes = [1024] if quick else [512, 1024, 2048]
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with phase("pd", pd_specs(quick), model_dir, log_dir) as specs:
            routers = [await start_router(p, specs[1]) for p in specs if p.role == "prefill"]
            try:
                await stream(session, routers[0].url, {"prompt": [5] * 300, "max_tokens": 2})  # warm up
                out["exposed"] = {"layerwise": [await exposed_fraction(session, routers[0].url, specs[0].url, n, reps)
                                                for n in sizes]}
                if len(routers) > 1:
                    out["exposed"]["serialized"] = [await exposed_fraction(session, routers[1].url, specs[2].url,
                                                                           n, reps) for n in sizes]
                log(f"exposed {out['exposed']}")
                ours = {e["num_tokens"]: e["ttft_s"] for e in out["exposed"]["layerwise"]}
                t_prefill = next(e for e in out["exposed"]["layerwise"] if e["num_tokens"] == 1024)["prefill_s_per_req"]
                duration = 30.0 if quick else 90.0
                # P at ~35% busy with long prompts, but at least ~4 of them in the window
                load = {"duration_s": duration, "rate": round(max(0.35 / max(t_prefill, 0.05), 4 / duration), 3),
                        "long_tokens": 1024, "num_decoders": 4}
                out["mixed_load"] = {"offered": load, "pd": await mixed_load(session, routers[0].url, **load)}
                log(f"pd load {out['mixed_load']['pd']}")
            finally:
                for r in routers:
                    await r.stop()
        async with phase("nixl", nixl_specs(), model_dir, log_dir) as (p, d):
            await nixl_request(session, p.url, d.url, {"prompt": [5] * 300, "max_tokens": 2})  # warm up
            nixl = {n: await ttft_nixl(session, p.url, d.url, n, reps) for n in ttft_sizes}
        med = statistics.median
        out["ttft_vs_nixl"] = [{"num_tokens": n, "ours_ttft_s": med(ours[n]), "nixl_ttft_s": med(nixl[n]["ttft"]),
                                "ratio": med(ours[n]) / med(nixl[n]["ttft"]),
                                "nixl_handoff_s": med(nixl[n]["handoff"])} for n in ttft_sizes]
        log(f"ttft {out['ttft_vs_nixl']}")
        for cores in (["0"] if quick else ["0", "0,1"]):
            async with phase(f"colocated_{cores}", colocated_specs(cores), model_dir, log_dir) as (colo,):
                out["mixed_load"][f"colocated_{cores}"] = await mixed_load(session, colo.url, **load)
            log(f"colocated {cores}: {out['mixed_load'][f'colocated_{cores}']}")
    return summarize(out)


def summarize(out: dict) -> dict:
    ml = out["mixed_load"]
    colo = {k: v for k, v in ml.items() if k.startswith("colocated")}
    best = min(colo, key=lambda k: colo[k]["p99_tbt_s"] or float("inf"))
    lw_1k = next(e for e in out["exposed"]["layerwise"] if e["num_tokens"] == 1024)
    ttft_1k = next(t for t in out["ttft_vs_nixl"] if t["num_tokens"] == 1024)
    summary = {
        "push_vs_loopback_ratio": out["push"]["ratio"],
        "exposed_fraction_1k_layerwise": lw_1k["exposed_fraction"],
        "ttft_vs_nixl_ratio": ttft_1k["ratio"],
        "p99_tbt_ratio": _ratio(ml["pd"]["p99_tbt_s"], colo[best]["p99_tbt_s"]),
        "throughput_ratio": ml["pd"]["tokens_per_s"] / colo[best]["tokens_per_s"],
        "p99_ttft_ratio": _ratio(ml["pd"]["p99_ttft_s"], colo[best]["p99_ttft_s"]),
        "colocated_best_setting": best,
        "load1_end": os.getloadavg()[0],
    }
    return {**summary, "details": out}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def write_profile(result: dict, path: Path) -> None:
    """Measured per-phase times in the planner's schema (vllm_disagg/planner/profile.py)."""
    d = result["details"]
    lw = d["exposed"]["layerwise"]
    prof = {"schema": "vllm-disagg-profile/1", "device": f"cpu x{os.cpu_count()} (1 core per instance)",
            "model": "smollm2-135m",
            "prefill": [{"num_tokens": e["num_tokens"], "ms": 1e3 * e["prefill_s_per_req"]} for e in lw],
            # the latency a push adds (layer-wise: the exposed part; the rest hides behind prefill)
            "kv_transfer": [{"num_tokens": e["num_tokens"], "ms": 1e3 * e["exposed_s"] / max(e["pushes"], 1)}
                            for e in lw]}
    # No "measured" block: the mixed-load phase (a few long prompts among closed-loop short decodes) is not
    # the fixed-shape Poisson workload `plan splitwise --validate` replays; benchmarks/pd_calibrate.py measures one.
    path.write_text(json.dumps(prof, indent=1))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = result["details"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for mode, rows in d["exposed"].items():
        a.plot([r["num_tokens"] for r in rows], [100 * (r["exposed_fraction"] or 0) for r in rows], "o-", label=mode)
    a.axhline(5, color="grey", ls="--", label="goal (layer-wise, 1k)")
    a.set(xlabel="prompt tokens", ylabel="exposed transfer, % of prefill", title="KV transfer not hidden")
    a.legend()
    rows = d["ttft_vs_nixl"]
    xs = range(len(rows))
    b.bar([x - 0.2 for x in xs], [r["ours_ttft_s"] for r in rows], 0.4, label="disagg push (router)")
    b.bar([x + 0.2 for x in xs], [r["nixl_ttft_s"] for r in rows], 0.4, label="NixlConnector (pull)")
    b.set_xticks(list(xs), [str(r["num_tokens"]) for r in rows])
    b.set(xlabel="prompt tokens", ylabel="TTFT (s, median)", title="1P+1D TTFT")
    b.legend()
    ml = {k: v for k, v in d["mixed_load"].items() if k != "offered"}
    names = list(ml)
    c.bar([n + "\np99 TBT" for n in names], [ml[n]["p99_tbt_s"] for n in names])
    c.set(ylabel="seconds", title=f"mixed load, {d['mixed_load']['offered']['rate']}/s long prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(result: dict, suffix: str) -> None:
    """results/pd_bench{suffix}.json + .png, and the planner profile (schema vllm-disagg-profile/1)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"pd_bench{suffix}.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / f"pd_bench{suffix}.png")
    if (Path(__file__).parents[1] / "vllm_disagg/planner/profile.py").exists():
        write_profile(result, RESULTS / f"pd_profile{suffix}.json")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="< 5 min; prints one JSON object")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # run the `finally`s: stop every server
    log_dir = Path(tempfile.mkdtemp(prefix="pd-bench-logs-"))  # kept: instance logs for post-mortems
    log(f"instance logs in {log_dir}")
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        model_dir = make_tiny_llama(Path(tmp) / "model", **SMOLLM2_SHAPE)
        result = asyncio.run(run(args.quick, model_dir, log_dir))
    save(result, "_quick" if args.quick else "")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
