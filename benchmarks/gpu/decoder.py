# SPDX-License-Identifier: Apache-2.0
"""A LLaMA decoder layer in plain torch, split into the NanoFlow op graph's ops (step b, part 2).

Random weights (bf16 on the GPU), one layer's weights and one paged KV cache reused by every layer
of the stack (`num_layers` only sets how long the pipeline runs). A decode step: each of `batch`
requests adds one token at position `context - 1`. Ops, per the graph in `nanoflow/graph.py`:
`kqv` (RMSNorm, QKV GEMM, RoPE, KV-cache write), `attn` (paged decode attention: gather the
request's blocks, torch SDPA), `o` (O GEMM + residual), `ugd` (RMSNorm, gate/up GEMM, SiLU, down
GEMM + residual). Rows of a nano-batch are a contiguous slice of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int = 16

    @classmethod
    def of(cls, model: str) -> LayerShape:
        from vllm_disagg.planner.catalog import get_model

        spec = get_model(model)
        head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
        return cls(spec.hidden_size, spec.num_heads, spec.num_kv_heads, head_dim, spec.intermediate_size)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


TINY = LayerShape(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, block_size=4)


class DecoderLayer:
    """Weights, a paged KV cache, and the per-nano-batch ops of one decode step."""

    def __init__(self, shape: LayerShape, batch: int, context: int, device: str, dtype: Any, seed: int = 0,
                 kv_layout: str = "paged"):
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: GBs of KV
        s, self.shape, self.batch, self.context = shape, shape, batch, context
        self.device, self.dtype = torch.device(device), dtype

        def rand(*size: int, std: float = 1.0) -> torch.Tensor:
            return torch.randn(*size, generator=gen, device=device, dtype=dtype).mul_(std)

        self.w_qkv = rand(s.hidden, s.q_dim + 2 * s.kv_dim, std=s.hidden ** -0.5)
        self.w_o = rand(s.q_dim, s.hidden, std=s.q_dim ** -0.5)
        self.w_gate_up = rand(s.hidden, 2 * s.intermediate, std=s.hidden ** -0.5)
        self.w_down = rand(s.intermediate, s.hidden, std=s.intermediate ** -0.5)
        blocks_per_req = math.ceil(context / s.block_size)
        perm = torch.randperm(batch * blocks_per_req, generator=gen, device=device)
        self.block_table = perm.view(batch, blocks_per_req)  # scattered blocks, as a paged cache has them
        self.kv_layout = kv_layout
        """"paged": scattered blocks, gathered before attention (what a paged cache costs torch);
        "contiguous": one [Hkv, context, D] run per request, read in place: the bound a paged kernel that
        reads blocks directly (FlashAttention, FlashInfer) approaches."""
        if kv_layout == "contiguous":
            self.kv = rand(2, batch, s.num_kv_heads, context, s.head_dim)
        else:
            self.kv = rand(2, batch * blocks_per_req, s.block_size, s.num_kv_heads, s.head_dim)
        pos = self.pos = context - 1  # the new token of every request
        self.slots = self.block_table[:, pos // s.block_size] * s.block_size + pos % s.block_size
        inv = 1.0 / (10000 ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        angle = pos * inv
        self.cos, self.sin = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
        self.x = rand(batch, s.hidden)  # the residual stream, updated in place layer by layer
        self.x0 = self.x.clone()
        self.q = torch.empty(batch, s.num_heads, s.head_dim, device=device, dtype=dtype)
        self.attn_out = torch.empty(batch, s.q_dim, device=device, dtype=dtype)
        self.scale = s.head_dim ** -0.5

    def reset(self) -> None:
        self.x.copy_(self.x0)

    def kqv(self, rows: slice) -> None:
        s = self.shape
        qkv = _rms_norm(self.x[rows]) @ self.w_qkv
        q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        self.q[rows] = self._rope(q.view(-1, s.num_heads, s.head_dim))
        k = self._rope(k.view(-1, s.num_kv_heads, s.head_dim))
        if self.kv_layout == "contiguous":
            self.kv[0, rows, :, self.pos] = k
            self.kv[1, rows, :, self.pos] = v.view(-1, s.num_kv_heads, s.head_dim)
            return
        flat = self.kv.view(2, -1, s.num_kv_heads, s.head_dim)
        flat[0, self.slots[rows]] = k
        flat[1, self.slots[rows]] = v.view(-1, s.num_kv_heads, s.head_dim)

    def _rope(self, t: torch.Tensor) -> torch.Tensor:
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * self.cos - odd * self.sin, even * self.sin + odd * self.cos), dim=-1).flatten(-2)

    def attn(self, rows: slice) -> None:
        s = self.shape
        if self.kv_layout == "contiguous":
            k, v = self.kv[0, rows], self.kv[1, rows]  # [R, Hkv, context, D]: no copy
        else:
            k, v = self.kv[:, self.block_table[rows]].flatten(2, 3).unbind(0)  # [R, blocks*bs, Hkv, D]: gathered
            k, v = k[:, : self.context].transpose(1, 2), v[:, : self.context].transpose(1, 2)
        q = self.q[rows].unsqueeze(2)  # [R, H, 1, D]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True)
        self.attn_out[rows] = out.reshape(-1, s.q_dim)

    def o(self, rows: slice) -> None:
        self.x[rows] += self.attn_out[rows] @ self.w_o

    def ugd(self, rows: slice) -> None:
        gate, up = (_rms_norm(self.x[rows]) @ self.w_gate_up).chunk(2, dim=-1)
        self.x[rows] += (F.silu(gate) * up) @ self.w_down

    def op(self, name: str, rows: slice):
        return getattr(self, name), rows


def _rms_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def split_rows(batch: int, parts: int) -> list[slice]:
    base, extra = divmod(batch, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(slice(start, start + size))
        start += size
    return out


def step_fns(layer: DecoderLayer, num_layers: int, num_attn_batches: int, num_dense_batches: int) -> tuple[list, Any, dict]:
    """(graph nodes, a list schedule costed by row counts, {op key: callable}) for one decode step."""
    from vllm_disagg.nanoflow.graph import PipelineSpec, build_graph, list_schedule

    spec = PipelineSpec(num_layers=num_layers, num_attn_batches=num_attn_batches,
                        num_dense_batches=num_dense_batches)
    nodes = build_graph(spec)
    fine, coarse = split_rows(layer.batch, num_attn_batches), split_rows(layer.batch, num_dense_batches)
    weight = {"kqv": 1.0, "attn": 3.0, "o": 0.5, "ugd": 2.5}  # relative op cost per row: only orders the lists
    rows_of = {name: (fine if name in ("kqv", "attn") else coarse) for name in weight}
    schedule = list_schedule(nodes, lambda n: weight[n.name] * (rows_of[n.name][n.nb].stop - rows_of[n.name][n.nb].start))
    fns = {}
    for n in nodes:
        method, rows = getattr(layer, n.name), rows_of[n.name][n.nb]
        fns[n.key] = (lambda m=method, r=rows: m(r))
    return nodes, schedule, fns


def run_step(layer: DecoderLayer, executor: Any, plan: tuple[list, Any, dict]) -> None:
    nodes, schedule, fns = plan
    executor.run(nodes, schedule, fns)
