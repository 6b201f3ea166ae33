# SPDX-License-Identifier: Apache-2.0
"""The per-layer exchange of remote attention, measured through the real client and server code.

- `rtt_us_shm` / `rtt_us_tcp`: median round trip of one decode layer's exchange (q, k, v out; the
  attention output back; LLaMA-8B layer shape, batch 1), the server answering without computing
  (`--kernel none`): the transport round trip Lamina's 33 us figure measures. The shm rings spin then
  block, and both processes are pinned to their own cores. `rtt_full_us_*` adds vLLM's CPU kernel;
  `raw_pingpong_us_*` echoes the same bytes over the bare channel.
- `bytes_per_token_per_layer`: payload bytes of that exchange per token, against (2 + 2/G)·d·e.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

TOKEN = "attn-bench-token"
# A LLaMA-3-8B-shaped attention layer for the RTT (d = 4096, G = 4), float32 on this CPU box.
RTT_GEOM = dict(num_layers=1, num_heads=32, num_kv_heads=8, head_size=128, block_size=32,
                dtype="float32", max_num_tokens=256)


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


def start_servers(specs: dict[str, tuple[str, str, bool]], kv_cache_gib: float = 1.0) -> dict:
    """Start attention server processes concurrently: name -> (transport, kernel, spin+pin).
    Spinning servers are pinned to SERVER_CPU (every thread; later ones inherit the mask)."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_disagg.testing.attention import start_local_server

    def one(spec):
        kind, kernel, fast = spec
        extra = ("--kernel", kernel, *(("--spin-us", str(SPIN_US)) if fast else ()))
        srv = start_local_server(transport=kind, kv_cache_gib=kv_cache_gib, env={"VLLM_DISAGG_AUTH_TOKEN": TOKEN},
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
