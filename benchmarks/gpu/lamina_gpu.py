# SPDX-License-Identifier: Apache-2.0
"""Step c: Lamina's attention path on a GPU, with the kernel that runs there (`TorchPagedKernel`:
torch SDPA; vLLM's FlashAttention needs the vLLM wheel, and FlashInfer's JIT build does not fit a
step's minutes).

* kernel_exactness_<dtype>: LLaMA-8B attention geometry, decode requests of mixed context. Against a
  float64 reference: the full kernel; head partitions (2 and 4 shards, `partition.head_shards`);
  a request partition (2 servers); Lamina's send-Q-early split (`attend_prev` + the new token,
  merged by `merge.merge_attn_states`); and a sequence split (two halves of each request's KV,
  merged by their LSEs). ‖out − ref‖ / ‖ref‖ each.
* server_path_exactness: the same through the real thing: attention server processes
  (`python -m vllm_disagg.attention.cli --kernel torch`) and `DisaggAttentionClient`, head-partitioned
  (Q sent early, and not) and request-partitioned over 2 servers, a chunked prefill then decode
  steps, against the in-process kernel.
* round_trip: one decode layer from the model process (q, k, v on the GPU) to a server process on
  the same GPU and back, at batch 1 / context 32 and batch 32 / context 1024: the whole call (GPU to
  host copies included), the server's kernel time, and local attention in-process as the baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import REPO, Budget, StepResult, cuda_ready, rel_error, summary_ms, time_cuda

TOKEN = "gpu-kit-token"
GEOM = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16)
GEOM_TWIN = dict(num_heads=8, num_kv_heads=4, head_size=16, block_size=4)
LIMITS = {"float32": 1e-5, "bfloat16": 1e-2}
CHECKS = ("kernel_exactness_float32", "kernel_exactness_bfloat16", "server_path_exactness", "round_trip")


def run_step(device: str, budget: Budget) -> StepResult:
    result = StepResult("c", "Lamina on a GPU: LSE-merge exactness, partitions, model->server round trip", device)
    twin = device != "cuda" or cuda_ready() is not None
    if device == "cuda" and twin:
        for name in CHECKS:
            result.skip(name, cuda_ready())
        return result
    dev, geom = ("cpu", GEOM_TWIN) if twin else ("cuda", GEOM)
    contexts = [5, 17, 40, 9] if twin else [37, 200, 511, 1024, 1500, 64, 999, 2048]
    for dtype in ("float32", "bfloat16"):
        result.run(f"kernel_exactness_{dtype}", lambda d=dtype: kernel_exactness(dev, geom, d, contexts), budget, 30)
    result.run("server_path_exactness", lambda: server_path_exactness(dev, geom, contexts[:4]), budget, 90)
    shapes = [(1, 32), (4, 24)] if twin else [(1, 32), (32, 1024)]
    result.run("round_trip", lambda: round_trip(dev, geom, shapes, iters=5 if twin else 200), budget, 120)
    return result


def _geometry(geom: dict, dtype: str, num_layers: int = 1, heads: tuple[int, int] | None = None):
    from vllm_disagg.attention.wire import Geometry

    hq, hkv = heads or (geom["num_heads"], geom["num_kv_heads"])
    return Geometry(num_layers=num_layers, num_heads=hq, num_kv_heads=hkv, head_size=geom["head_size"],
                    block_size=geom["block_size"], dtype=dtype, max_num_tokens=8192)


class Batch:
    """Decode requests of mixed context: a scattered block table, every token's K/V kept on CPU (fp64
    reference), the prefill step that writes them and the decode step that adds one token each."""

    def __init__(self, geom: dict, contexts: list[int], dtype: Any, seed: int = 0):
        import torch

        from vllm_disagg.attention.wire import StepMeta

        gen = torch.Generator().manual_seed(seed)
        bs, hq, hkv, d = geom["block_size"], geom["num_heads"], geom["num_kv_heads"], geom["head_size"]
        self.contexts, self.bs = contexts, bs
        cols = max(-(-(c + 1) // bs) for c in contexts)
        perm = torch.randperm(len(contexts) * cols, generator=gen).to(torch.int32) + 1
        self.table = perm.view(len(contexts), cols)
        self.num_blocks = len(contexts) * cols + 1
        total = sum(contexts) + len(contexts)
        self.k = torch.randn(total, hkv, d, generator=gen).to(dtype)
        self.v = torch.randn(total, hkv, d, generator=gen).to(dtype)
        self.q = torch.randn(len(contexts), hq, d, generator=gen).to(dtype)  # the decode queries
        lens = torch.tensor(contexts)
        self.prefill = StepMeta(torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32),
                                lens.to(torch.int32), self.table, self._slots([range(c) for c in contexts]))
        self.decode = StepMeta(torch.arange(len(contexts) + 1, dtype=torch.int32), (lens + 1).to(torch.int32),
                               self.table, self._slots([range(c, c + 1) for c in contexts]))
        starts = [0, *torch.tensor([c + 1 for c in contexts]).cumsum(0).tolist()]
        self.prefill_rows = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, contexts)])
        self.decode_rows = torch.tensor([s + c for s, c in zip(starts, contexts)])
        self.rows_of = [torch.arange(s, s + c + 1) for s, c in zip(starts, contexts)]
        self.prefill_q = torch.randn(sum(contexts), hq, d, generator=gen).to(dtype)

    def _slots(self, positions: list[range]):
        import torch

        return torch.cat([self.table[r, torch.tensor(list(p)) // self.bs].long() * self.bs
                          + torch.tensor(list(p)) % self.bs for r, p in enumerate(positions)])

    def reference(self, scale: float):
        """float64 decode attention of every request over its whole context + the new token."""
        import torch

        from vllm_disagg.attention.merge import partial_attention

        outs = []
        for r, rows in enumerate(self.rows_of):
            out, _ = partial_attention(self.q[r:r + 1].double(), self.k[rows][None].double(),
                                       self.v[rows][None].double(), scale)
            outs.append(out[0])
        return torch.stack(outs)


def _kernel(geom: dict, dtype: str, device: str, num_blocks: int, heads: tuple[int, int] | None = None):
    from vllm_disagg.attention.kernels import TorchPagedKernel

    return TorchPagedKernel(_geometry(geom, dtype, heads=heads), num_blocks, device=device)


def kernel_exactness(device: str, geom: dict, dtype_name: str, contexts: list[int]) -> dict:
    import torch

    from vllm_disagg.attention.merge import merge_attn_states, partial_attention
    from vllm_disagg.attention.partition import head_shards

    dtype = getattr(torch, dtype_name)
    batch = Batch(geom, contexts, dtype)
    scale = geom["head_size"] ** -0.5
    ref = batch.reference(scale)
    hq, d = geom["num_heads"], geom["head_size"]

    def run(kern, sel_q=slice(None), sel_kv=slice(None), reqs=None):
        reqs = list(range(len(contexts))) if reqs is None else reqs
        pre, dec = batch.prefill, batch.decode
        kern.write_kv(0, batch.k[batch.prefill_rows][:, sel_kv], batch.v[batch.prefill_rows][:, sel_kv], pre)
        kern.write_kv(0, batch.k[batch.decode_rows][:, sel_kv], batch.v[batch.decode_rows][:, sel_kv], dec)
        sub = _sub_step(dec, reqs)
        out = torch.full((len(reqs), batch.q[:, sel_q].shape[1], d), float("nan"), dtype=dtype)
        kern.attend(0, batch.q[reqs][:, sel_q], sub, kern.prepare(sub), scale, out)
        return out

    errors = {"full": rel_error(run(_kernel(geom, dtype_name, device, batch.num_blocks)), ref)}
    for n in (2, 4):
        parts = [run(_kernel(geom, dtype_name, device, batch.num_blocks, (s.num_heads, s.num_kv_heads)),
                     s.q_heads, s.kv_heads) for s in head_shards(n, hq, geom["num_kv_heads"])]
        errors[f"head_partition_{n}"] = rel_error(torch.cat(parts, dim=1), ref)
    halves = [list(range(0, len(contexts), 2)), list(range(1, len(contexts), 2))]
    out = torch.empty_like(batch.q)
    for reqs in halves:
        out[reqs] = run(_kernel(geom, dtype_name, device, batch.num_blocks), reqs=reqs)
    errors["request_partition_2"] = rel_error(out, ref)
    kern = _kernel(geom, dtype_name, device, batch.num_blocks)
    run(kern)  # writes every token; the early half reads only the first seq_len - 1 of them
    prev, lse_prev = kern.attend_prev(0, batch.q, batch.decode, scale)
    new_k, new_v = batch.k[batch.decode_rows][:, None], batch.v[batch.decode_rows][:, None]
    new, lse_new = partial_attention(batch.q, new_k, new_v, scale)
    errors["send_q_early_lse_merge"] = rel_error(merge_attn_states(prev, lse_prev, new, lse_new)[0], ref)
    errors["sequence_split_lse_merge"] = rel_error(_sequence_split(batch, scale, device), ref)
    limit = LIMITS[dtype_name]
    bad = {k: v for k, v in errors.items() if not v <= limit}
    if bad:
        raise RuntimeError(f"{dtype_name}: relative error over {limit}: {bad}")
    return {"rel_error_vs_float64": {k: float(f"{v:.3g}") for k, v in errors.items()}, "limit": limit,
            "contexts": contexts, "geometry": geom}


def _sub_step(meta, reqs: list[int]):
    import torch

    from vllm_disagg.attention.wire import StepMeta

    idx = torch.tensor(reqs)
    return StepMeta(torch.arange(len(reqs) + 1, dtype=torch.int32), meta.seq_lens[idx], meta.block_table[idx],
                    meta.slot_mapping[idx])


def _sequence_split(batch: Batch, scale: float, device: str):
    """Each request's keys in two halves on the device, attended separately, merged by LSE."""
    import torch

    from vllm_disagg.attention.merge import merge_attn_states, partial_attention

    outs = []
    for r, rows in enumerate(batch.rows_of):
        cut = len(rows) // 2
        q = batch.q[r:r + 1].to(device)
        parts = [partial_attention(q, batch.k[rows[a:b]][None].to(device), batch.v[rows[a:b]][None].to(device), scale)
                 for a, b in ((0, cut), (cut, len(rows)))]
        outs.append(merge_attn_states(*parts[0], *parts[1])[0][0].cpu())
    return torch.stack(outs)


# ------------------------------------------------------------------ through server processes
class Servers:
    """Attention server processes (`--kernel torch`), stopped on exit."""

    def __init__(self, num: int, device: str, transport: str = "shm", kv_cache_gib: float = 0.5):
        self.procs, self.https, tmp = [], [], Path(tempfile.mkdtemp(prefix="gpu-kit-attn-"))
        env = {**os.environ, "VLLM_DISAGG_AUTH_TOKEN": TOKEN, "PYTHONPATH": os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")])}
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the twin's servers compute on CPU
        readies = []
        for i in range(num):
            ready = tmp / f"ready{i}.json"
            cmd = [sys.executable, "-m", "vllm_disagg.attention.cli", "--kernel", "torch", "--transport", transport,
                   "--kv-cache-gib", str(kv_cache_gib), "--ready-file", str(ready), "--parent-pid", str(os.getpid())]
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            readies.append(ready)
        deadline = time.monotonic() + 180
        for proc, ready in zip(self.procs, readies):
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"attention server not ready: {proc.stderr.read().decode()[-1500:]}")
                time.sleep(0.05)
            self.https.append(json.loads(ready.read_text())["http"])

    def kernel_seconds(self) -> float:
        total = 0.0
        for http in self.https:
            with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
                total += sum(float(line.split()[-1]) for line in r.read().decode().splitlines()
                             if line.startswith("vllm:disagg_attention_layer_seconds_sum"))
        return total

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def server_path_exactness(device: str, geom: dict, contexts: list[int]) -> dict:
    import torch

    from vllm_disagg.attention.client import ClientMeta, DisaggAttentionClient

    batch = Batch(geom, contexts, torch.float32, seed=1)
    scale = geom["head_size"] ** -0.5
    local = _kernel(geom, "float32", device, batch.num_blocks)
    steps = [(batch.prefill, batch.prefill_q, batch.prefill_rows, max(contexts)),
             (batch.decode, batch.q, batch.decode_rows, 1)]
    expected = []
    for meta, q, rows, _ in steps:
        local.write_kv(0, batch.k[rows], batch.v[rows], meta)
        out = torch.empty_like(q)
        local.attend(0, q, meta, local.prepare(meta), scale, out)
        expected.append(out)
    servers = Servers(2, device)
    errors = {}
    try:
        for name, partition, early in (("head_2", "head", False), ("head_2_q_early", "head", True),
                                       ("request_2", "request", False)):
            client = DisaggAttentionClient(servers.https, transport="shm", partition=partition, send_q_early=early,
                                           auth_token=TOKEN)
            client.connect(num_layers=1, dtype="float32", max_num_tokens=8192,
                           **{k: geom[k] for k in ("num_heads", "num_kv_heads", "head_size", "block_size")})
            for i, (meta, q, rows, max_q) in enumerate(steps):
                out = torch.full_like(q, float("nan"))
                client.attend(0, q, batch.k[rows], batch.v[rows], ClientMeta(meta, max_q, q.shape[0]), scale, out)
                errors[f"{name}_{'prefill' if i == 0 else 'decode'}"] = rel_error(out, expected[i])
            client.close()
    finally:
        servers.close()
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    if bad:
        raise RuntimeError(f"server path differs from the in-process kernel: {bad}")
    return {"rel_error_vs_in_process_kernel": {k: float(f"{v:.3g}") for k, v in errors.items()},
            "servers": 2, "kernel": "torch", "transport": "shm", "contexts": contexts}


def round_trip(device: str, geom: dict, shapes: list[tuple[int, int]], iters: int) -> dict:
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dname = "bfloat16" if device == "cuda" else "float32"
    rows = []
    servers = Servers(1, device, kv_cache_gib=2.0 if device == "cuda" else 0.25)
    try:
        for batch_size, context in shapes:
            rows.append(_round_trip_one(servers, device, geom, dtype, dname, batch_size, context, iters))
    finally:
        servers.close()
    return {"rows": rows, "dtype": dname, "transport": "shm", "definition":
            "call_us: q/k/v from GPU memory to host, client.attend (one server process, same GPU), output back "
            "to the GPU; server_kernel_us: the server's write_kv + attend; local_us: the same attention "
            "in-process on the GPU (the baseline a model process would otherwise run)"}


def _round_trip_one(servers: Servers, device: str, geom: dict, dtype, dname: str, batch_size: int, context: int,
                    iters: int) -> dict:
    import torch

    from vllm_disagg.attention.client import ClientMeta, DisaggAttentionClient

    batch = Batch(geom, [context] * batch_size, dtype, seed=2)
    scale = geom["head_size"] ** -0.5
    client = DisaggAttentionClient(servers.https, transport="shm", send_q_early=False, auth_token=TOKEN)
    client.connect(num_layers=1, dtype=dname, max_num_tokens=8192,
                   **{k: geom[k] for k in ("num_heads", "num_kv_heads", "head_size", "block_size")})
    for r in range(batch_size):  # prefill request by request (bounded message size)
        meta = _prefill_of(batch, r)
        rows = batch.rows_of[r][:context]
        client.attend(0, batch.prefill_q[:context], batch.k[rows], batch.v[rows], ClientMeta(meta, context, context),
                      scale, torch.empty(context, geom["num_heads"], geom["head_size"], dtype=dtype))
    meta = ClientMeta(batch.decode, 1, batch_size)
    q, k, v = (t.to(device) for t in (batch.q, batch.k[batch.decode_rows], batch.v[batch.decode_rows]))
    out_host = torch.empty(batch_size, geom["num_heads"], geom["head_size"], dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call() -> None:
        client.attend(0, q.cpu(), k.cpu(), v.cpu(), meta, scale, out_host)
        out_host.to(device)
        sync()

    for _ in range(10):
        call()
    kernel0, times = servers.kernel_seconds(), []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    kernel_us = (servers.kernel_seconds() - kernel0) / iters * 1e6
    client.close()
    local = _kernel(geom, dname, device, batch.num_blocks)
    local.write_kv(0, batch.k[batch.prefill_rows], batch.v[batch.prefill_rows], batch.prefill)
    state, out = local.prepare(batch.decode), torch.empty(batch_size, geom["num_heads"], geom["head_size"],
                                                          dtype=dtype, device=device)

    def local_call() -> None:
        local.write_kv(0, k, v, batch.decode)
        local.attend(0, q, batch.decode, state, scale, out)

    local_ms = time_cuda(local_call, iters=50)["median_ms"] if device == "cuda" else float("nan")
    call_ms = summary_ms(times)
    return {"batch": batch_size, "context": context, "call_us": round(call_ms["median_ms"] * 1e3, 1),
            "call_p90_us": round(call_ms["p90_ms"] * 1e3, 1), "server_kernel_us": round(kernel_us, 1),
            "call_minus_kernel_us": round(call_ms["median_ms"] * 1e3 - kernel_us, 1),
            "local_us": round(local_ms * 1e3, 1), "iters": iters}


def _prefill_of(batch: Batch, r: int):
    import torch

    from vllm_disagg.attention.wire import StepMeta

    c = batch.contexts[r]
    return StepMeta(torch.tensor([0, c], dtype=torch.int32), torch.tensor([c], dtype=torch.int32),
                    batch.table[r:r + 1], batch.prefill.slot_mapping[sum(batch.contexts[:r]):sum(batch.contexts[:r + 1])])
