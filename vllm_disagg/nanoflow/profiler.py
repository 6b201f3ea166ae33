# SPDX-License-Identifier: Apache-2.0
"""Offline op profiling for the autosearch (paper §5.5): seconds per op vs nano-batch tokens and
execution-unit share, measured on this device.

Dense ops (KQV, O, UGD) are the model's GEMM shapes on random float weights; decode attention is
a GQA batched GEMV over a KV cache of `context_len` tokens per request (memory-bound, as on GPU).
Each measurement runs on a thread pinned to `share` cores with `share` torch threads, exactly
like a `CpuCoreGroup` unit. Network ops (TP all-reduce, remote-attention RPC) are not profiled
here: they are modelled from `NetModel` (latency + bytes / bandwidth), and say so in the plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vllm_disagg.models import hf_text_config
from vllm_disagg.nanoflow.units import CpuCoreGroup, allowed_cores

ATTN_CACHE_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        d = self.hidden
        return d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * self.intermediate

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelShape:
        cfg = hf_text_config(path)
        heads = cfg["num_attention_heads"]
        return cls(
            hidden=cfg["hidden_size"],
            intermediate=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        )


@dataclass(frozen=True)
class NetModel:
    """Modelled network-bound ops: TP all-reduce and the remote-attention round trip."""

    latency_s: float = 30e-6
    gbytes_per_s: float = 5.0
    rpc_s: float = 0.0
    """Remote attention: fixed round-trip seconds per call (0 = attention is local)."""
    tp: int = 1
    dtype_bytes: int = 4

    def all_reduce_s(self, tokens: int, hidden: int) -> float:
        nbytes = 2 * (self.tp - 1) / max(self.tp, 1) * tokens * hidden * self.dtype_bytes
        return self.latency_s + nbytes / (self.gbytes_per_s * 1e9)


@dataclass
class OpProfile:
    """Measured seconds keyed by op -> share -> tokens."""

    seconds: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)
    shape: ModelShape | None = None
    net: NetModel = NetModel()
    context_len: int = 256

    def record(self, op: str, share: int, tokens: int, secs: float) -> None:
        self.seconds.setdefault(op, {}).setdefault(share, {})[tokens] = secs

    def cost(self, op: str, tokens: int, share: int) -> float:
        if op in ("ar_o", "ar_d"):
            return self.net.all_reduce_s(tokens, self.shape.hidden if self.shape else 0)
        if op == "attn" and self.net.rpc_s > 0:
            return self.net.rpc_s
        by_share = self.seconds[op]
        usable = [s for s in by_share if s <= share] or [min(by_share)]
        return interpolate(by_share[max(usable)], tokens)

    def to_json(self) -> dict:
        return {
            "seconds": {
                op: {str(s): {str(t): v for t, v in row.items()} for s, row in d.items()}
                for op, d in self.seconds.items()
            },
            "shape": asdict(self.shape) if self.shape else None,
            "net": asdict(self.net),
            "context_len": self.context_len,
        }


def interpolate(table: dict[int, float], tokens: int) -> float:
    """Piecewise-linear in tokens; linear extrapolation from the largest size."""
    pts = sorted(table.items())
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return pts[-1][1] * tokens / pts[-1][0]


def _best_of(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def op_kernels(shape: ModelShape, tokens: int, context_len: int) -> dict[str, Callable[[], object]]:
    """The per-op work of one nano-batch of `tokens` tokens, on random weights."""
    lin = torch.nn.functional.linear
    d, q, kv, inter = shape.hidden, shape.q_size, shape.kv_size, shape.intermediate
    x, a = torch.randn(tokens, d), torch.randn(tokens, q)
    w_qkv, w_o = torch.randn(q + 2 * kv, d), torch.randn(d, q)
    w_gu, w_d = torch.randn(2 * inter, d), torch.randn(d, inter)
    hkv, g, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    ctx = max(16, min(context_len, ATTN_CACHE_BUDGET_BYTES // max(1, tokens * hkv * hd * 8)))
    qh = torch.randn(tokens, hkv, g, hd)
    k, v = torch.randn(tokens, hkv, ctx, hd), torch.randn(tokens, hkv, ctx, hd)

    def ugd() -> object:
        gu = lin(x, w_gu)
        return lin(torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:], w_d)

    def attn() -> object:
        scores = torch.matmul(qh, k.transpose(-1, -2)).softmax(-1)
        return torch.matmul(scores, v)

    return {"kqv": lambda: lin(x, w_qkv), "attn": attn, "o": lambda: lin(a, w_o), "ugd": ugd}


def _on_unit(share: int, cores: tuple[int, ...], job: Callable[[], None]) -> None:
    """Run `job` on a fresh thread bound like a CpuCoreGroup of `share` cores."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            CpuCoreGroup(f"profile-{share}", cores[:share]).bind()
            with torch.inference_mode():
                job()
        except BaseException as err:  # re-raised below
            errors.append(err)

    t = threading.Thread(target=target, name=f"nanoflow-profile-{share}")
    t.start()
    t.join()
    if errors:
        raise errors[0]


def profile_ops(
    shape: ModelShape,
    token_sizes: Iterable[int],
    shares: Iterable[int] | None = None,
    context_len: int = 256,
    reps: int = 3,
    net: NetModel | None = None,
    progress: Callable[[int], None] | None = None,
) -> OpProfile:
    cores = allowed_cores()
    shares = sorted(set(shares or range(1, len(cores) + 1)))
    prof = OpProfile(shape=shape, net=net or NetModel(), context_len=context_len)
    for share in shares:

        def job(share: int = share) -> None:
            for tokens in token_sizes:
                for op, fn in op_kernels(shape, tokens, context_len).items():
                    prof.record(op, share, tokens, _best_of(fn, reps))
                if progress:
                    progress(1)

        _on_unit(share, cores, job)
    return prof


def dense_seconds(prof: OpProfile, tokens: int, share: int) -> float:
    """One layer's dense work (KQV + O + UGD) for a whole batch of `tokens`."""
    return sum(prof.cost(op, tokens, share) for op in ("kqv", "o", "ugd"))


def peak_flops(prof: OpProfile, share: int) -> float:
    """Best measured dense FLOP/s over the profiled sizes (the cost model's `Compute`)."""
    assert prof.shape is not None
    flops_per_token = 2 * prof.shape.layer_params
    sizes = prof.seconds["ugd"][share]
    return max(flops_per_token * t / dense_seconds(prof, t, share) for t in sizes)
