# SPDX-License-Identifier: Apache-2.0
"""What pd_calibrate.py and serve_predict.py share: a 1P+1D deployment started in-process (SmolLM2-135M
shape, dummy weights, bf16 where the CPU has bf16 instructions, else float32: serve_deploy.engine_dtype),
a streaming client that records token times, and /metrics as numbers.

(These lived in pd_bench.py, which serve_bench.py replaced: its TTFT-vs-NIXL, exposed-transfer and
mixed-load figures are serve_bench's keys now, measured on a real trace; push vs raw TCP is
transport_bench.py's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

os.environ.setdefault("UCX_NET_DEVICES", "lo")
from serve_deploy import engine_dtype  # noqa: E402  (benchmarks/ is the script's directory)

from vllm_disagg.launch.local import InstanceSpec, LocalCluster, free_ports  # noqa: E402
from vllm_disagg.router.config import RouterConfig  # noqa: E402
from vllm_disagg.router.policy import SchedulerConfig  # noqa: E402
from vllm_disagg.router.server import Router, RouterServer  # noqa: E402

RESULTS = Path(__file__).parent / "results"
DTYPE = "bfloat16" if engine_dtype() == "auto" else "float32"
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                     torch_dtype=DTYPE, max_position_embeddings=8192)
VLLM_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--dtype", DTYPE,
             "--max-model-len", "4096", "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
             "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(384 << 20)]  # 17k tokens each


def log(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def pd_specs() -> list[InstanceSpec]:
    """Our 1P+1D, P layer-wise at every size: P on core 0, D on core 1."""
    ports = iter(free_ports(4))
    return [InstanceSpec("prefill", 0, next(ports), next(ports), "0", {"layerwise_threshold_tokens": 0}),
            InstanceSpec("decode", 0, next(ports), next(ports), "1")]


@contextlib.asynccontextmanager
async def phase(name: str, specs: list[InstanceSpec], model_dir: Path, log_dir: Path):
    """One set of servers at a time: this box has 2 cores and a shared NUMA node."""
    cluster = LocalCluster(specs, str(model_dir), "tcp", VLLM_ARGS, kv_cache_gib=None, log_dir=log_dir / name)
    try:
        cluster.start()
        await cluster.wait_healthy(420)
        log(f"phase {name}: {len(specs)} instance(s) healthy")
        yield cluster.specs
    finally:
        await asyncio.to_thread(cluster.stop)


async def start_router(p: InstanceSpec, d: InstanceSpec) -> RouterServer:
    cfg = RouterConfig(prefill_urls=[p.url], prefill_kv=[p.kv_addr], decode_urls=[d.url], read_timeout_s=600)
    server = RouterServer(Router(cfg, SchedulerConfig(None, None)), "127.0.0.1", 0)
    await server.start()
    return server


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


async def stream(session, url: str, body: dict, path: str = "/v1/completions", on_token=None) -> dict:
    """Send one streaming completion; token arrival times relative to the send (`on_token()` at each)."""
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
                    if on_token is not None:
                        on_token()
    return {"t0": t0, "times": times}


async def metrics(session, url: str) -> dict[str, float]:
    """Sum of every sample per name (labels folded) from a /metrics page."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out
