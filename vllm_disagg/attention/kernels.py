# SPDX-License-Identifier: Apache-2.0
"""Attention over a server's paged KV shard, one interface: vLLM's CPU kernel here, FlashAttention on GPU.

`AttentionKernel` owns the KV tensors of one shard (all layers x its KV heads) and answers
three calls per layer: `write_kv` (the scheduler's slot_mapping), `attend` (full attention,
vLLM's kernel, exactly what a local vLLM would compute) and `attend_prev` (attention over each
request's tokens *before* its new one, with the LSE, for send-Q-early).

`TorchPagedKernel` is plain torch (SDPA) on CPU or a CUDA device: what runs where vLLM does not (the
GPU kit's machine, `docs/gpu.md`). `CpuAttentionKernel` runs `CPUAttentionBackendImpl` with a stub
layer. Its kernel returns no LSE, so `attend_prev` reads the paged cache back in plain torch, which
`_probe_layout` checks at start-up (README.md, "kernels.py").
"""

from __future__ import annotations

import types
from abc import ABC, abstractmethod

import torch

from vllm_disagg.attention.wire import Geometry, StepMeta


class AttentionKernel(ABC):
    """Paged KV for one shard plus the attention that reads it.

    `caches` holds one tensor per layer; `block_dim` is the block axis in it. The block-level
    copies below (`retain.BlockStore`: whole blocks, all layers) serve KV retention."""

    supports_lse: bool = False
    block_dim: int = 0

    def __init__(self, geometry: Geometry, num_blocks: int):
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.caches: list[torch.Tensor] = []

    @property
    def block_nbytes(self) -> int:
        return kv_bytes_per_block(self.geometry) if self.caches else 0

    def save_block(self, block: int) -> torch.Tensor:
        if not self.caches:
            return torch.empty(0)
        return torch.stack([c.select(self.block_dim, block) for c in self.caches])

    def load_block(self, data: torch.Tensor, block: int) -> None:
        for layer, c in enumerate(self.caches):
            c.select(self.block_dim, block).copy_(data[layer])

    def copy_blocks(self, src, dst) -> None:
        # block by block: a plain copy per block is ~300x faster here than index_select + index_copy_
        for c in self.caches:
            for s, d in zip(src, dst):
                c.select(self.block_dim, d).copy_(c.select(self.block_dim, s))

    @abstractmethod
    def prepare(self, meta: StepMeta, sched_window: int = -1) -> object:
        """Per-step state shared by the layers of one scheduler window (the CPU scheduler metadata)."""

    def sched_window(self, layer: int) -> int:
        return self.geometry.layer(layer).sched_window

    @abstractmethod
    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, meta: StepMeta) -> None: ...

    @abstractmethod
    def attend(self, layer: int, query: torch.Tensor, meta: StepMeta, state: object, scale: float,
               out: torch.Tensor) -> None:
        """Full causal attention of `query` [T, H, D] over the cache (k/v already written)."""

    def attend_prev(self, layer: int, query: torch.Tensor, meta: StepMeta, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode-only: attention of each request's one query over its first seq_len - 1 tokens."""
        raise NotImplementedError(f"{type(self).__name__} cannot return the LSE")


def kv_bytes_per_block(g: Geometry) -> int:
    """Bytes of one block id across all layers of this shard (K and V; fp8 caches store bytes)."""
    elt = torch.empty((), dtype=g.cache_torch_dtype).element_size()
    return g.num_layers * g.num_kv_heads * g.block_size * 2 * g.head_size * elt


def _request_amx(isa: str) -> None:
    """Linux gives a process AMX tile state only once it asks (arch_prctl XCOMP_PERM). A vLLM engine
    asks through oneDNN's first bf16 matmul; a server runs no matmul, so its first AMX attention died
    of SIGILL on AMX CPUs. Ask up front, and refuse to start if the kernel says no."""
    if isa == "amx" and not torch.cpu._init_amx():
        raise RuntimeError("attention server: vLLM picked its AMX attention kernel, but Linux refused this "
                           "process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); run a float32 model "
                           "or a kernel that allows AMX")


class CpuAttentionKernel(AttentionKernel):
    """vLLM's CPU attention (`CPUAttentionBackendImpl`) on a cache `[L][NB, Hkv, bs, 2D]`, each layer
    with its own variant (`Geometry.layers`: window, soft-cap, ALiBi, sinks, fp8 scales) exactly as
    vLLM builds that layer's impl."""

    def __init__(self, geometry: Geometry, num_blocks: int):
        super().__init__(geometry, num_blocks)
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

        g = geometry
        self.isa = _get_attn_isa(g.torch_dtype, g.block_size, g.head_size, g.kv_cache_dtype)
        _request_amx(self.isa)
        # the stub layers the impl reads: ISA and the fp8 scales (1.0 unless the checkpoint has them)
        self.layers = [types.SimpleNamespace(isa=self.isa, _k_scale_float=g.layer(i).k_scale,
                                             _v_scale_float=g.layer(i).v_scale) for i in range(g.num_layers)]
        self.caches = [
            torch.zeros(num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_size, dtype=g.cache_torch_dtype)
            for _ in range(g.num_layers)
        ]
        # the impl's key/value halves of each layer's cache, made once instead of per call
        self._kv_halves = [c.view(num_blocks, g.num_kv_heads, 2 * g.block_size, g.head_size).chunk(2, dim=2)
                           for c in self.caches]
        self._impl_cls = CPUAttentionBackendImpl
        self._impls: dict[tuple[int, float], CPUAttentionBackendImpl] = {}
        # the torch LSE path (send-Q-early) implements plain attention on a model-dtype cache only
        self.supports_lse = g.plain and _probe_layout(self.isa, g)

    def _impl(self, layer: int, scale: float):
        impl = self._impls.get((layer, scale))
        if impl is None:
            from vllm.config import set_current_vllm_config

            g, a = self.geometry, self.geometry.layer(layer)
            # The impl reads two fields of the engine config; the server has no engine.
            stub = types.SimpleNamespace(
                model_config=types.SimpleNamespace(dtype=g.torch_dtype),
                parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
            )
            sinks = None if a.sinks is None else torch.tensor(a.sinks, dtype=getattr(torch, a.sinks_dtype))
            with set_current_vllm_config(stub):  # type: ignore[arg-type]
                impl = self._impl_cls(g.num_heads, g.head_size, scale, g.num_kv_heads,
                                      None if a.alibi_slopes is None else list(a.alibi_slopes), a.sliding_window,
                                      g.kv_cache_dtype, a.logits_soft_cap, sinks=sinks)
            self._impls[(layer, scale)] = impl
        return impl

    def prepare(self, meta: StepMeta, sched_window: int = -1):
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

        g = self.geometry
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=meta.num_reqs, num_heads=g.num_heads, num_kv_heads=g.num_kv_heads,
            head_dim=g.head_size, seq_lens=meta.seq_lens, dtype=g.torch_dtype,
            query_start_loc=meta.query_start_loc, causal=True, sliding_window_size=sched_window,
            isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=g.kv_cache_dtype,
        )
        qsl = meta.query_start_loc
        max_q = int((qsl[1:] - qsl[:-1]).max()) if meta.num_reqs else 0
        return CPUAttentionMetadata(
            num_actual_tokens=int(qsl[-1]), max_query_len=max_q, query_start_loc=qsl,
            max_seq_len=int(meta.seq_lens.max()) if meta.num_reqs else 0, seq_lens=meta.seq_lens,
            block_table=meta.block_table, slot_mapping=meta.slot_mapping,
            scheduler_metadata=sched, causal=True,
        )

    def write_kv(self, layer, key, value, meta):
        # = CPUAttentionBackendImpl.do_kv_cache_update (decoder) without its per-call views
        from vllm import _custom_ops as ops

        kc, vc = self._kv_halves[layer]
        stub = self.layers[layer]
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, meta.slot_mapping, self.isa, k_scale=stub._k_scale_float,
                                       v_scale=stub._v_scale_float, kv_cache_dtype=self.geometry.kv_cache_dtype)

    def attend(self, layer, query, meta, state, scale, out):
        self._impl(layer, scale).forward(self.layers[layer], query, None, None, self.caches[layer], state, out)

    def attend_prev(self, layer, query, meta, scale):
        if not self.supports_lse:
            raise NotImplementedError(f"block layout of ISA {self.isa!r} unknown; no send-Q-early")
        g = self.geometry
        ctx = meta.seq_lens.long() - 1
        n = max(1, -(-int(ctx.max()) // g.block_size))
        r, group = query.shape[0], g.num_heads // g.num_kv_heads
        raw = self.caches[layer].view(self.num_blocks, g.num_kv_heads, 2, g.block_size * g.head_size)
        blocks = raw[meta.block_table[:, :n].long()]  # one gather: [R, n, Hkv, 2, bs*D]
        # read the blocks in their own layout (K [D, bs], V [bs, D]) instead of copying to [L, D]
        k = blocks[:, :, :, 0].view(r, n, g.num_kv_heads, g.head_size, g.block_size)
        v = blocks[:, :, :, 1].view(r, n, g.num_kv_heads, g.block_size, g.head_size)
        q = query.float().view(r, g.num_kv_heads, group, g.head_size)
        logits = torch.einsum("rhgd,rnhdt->rhgnt", q, k.float()).reshape(r, g.num_kv_heads, group, -1) * scale
        mask = torch.arange(n * g.block_size)[None, :] < ctx[:, None]
        logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        out = torch.einsum("rhgnt,rnhtd->rhgd", probs.view(r, g.num_kv_heads, group, n, g.block_size), v.float())
        return out.reshape(r, g.num_heads, g.head_size).to(query.dtype), lse.reshape(r, g.num_heads)


def read_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int, g: Geometry
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [R, n*bs, Hkv, D] of the first ceil(length/bs) blocks of each row ("vec" layout:
    a K block is stored [D, bs] per head, a V block [bs, D])."""
    num_reqs = block_table.shape[0]
    n = max(1, -(-length // g.block_size))
    raw = cache.view(cache.shape[0], g.num_kv_heads, 2, g.block_size * g.head_size)
    blocks = raw[block_table[:, :n].long()]  # [R, n, Hkv, 2, bs*D]
    k = blocks[:, :, :, 0].view(num_reqs, n, g.num_kv_heads, g.head_size, g.block_size)
    v = blocks[:, :, :, 1].view(num_reqs, n, g.num_kv_heads, g.block_size, g.head_size)
    k = k.permute(0, 1, 4, 2, 3).reshape(num_reqs, n * g.block_size, g.num_kv_heads, g.head_size)
    v = v.permute(0, 1, 3, 2, 4).reshape(num_reqs, n * g.block_size, g.num_kv_heads, g.head_size)
    return k, v


def _probe_layout(isa: str, g: Geometry) -> bool:
    """Write random k/v with the real kernel and check `read_blocks` reads them back."""
    from vllm import _custom_ops as ops

    if isa != "vec":
        return False
    cache = torch.zeros(3, g.num_kv_heads, g.block_size, 2 * g.head_size, dtype=g.torch_dtype)
    n = g.block_size + 3
    key = torch.randn(n, g.num_kv_heads, g.head_size).to(g.torch_dtype)
    value = torch.randn(n, g.num_kv_heads, g.head_size).to(g.torch_dtype)
    kv = cache.view(3, g.num_kv_heads, 2 * g.block_size, g.head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, kv[0], kv[1], torch.arange(n) + g.block_size, isa)
    k, v = read_blocks(cache, torch.tensor([[1, 2]], dtype=torch.int32), n, g)
    return bool(torch.equal(k[0, :n], key) and torch.equal(v[0, :n], value))


class FlashAttentionKernel(AttentionKernel):
    """GPU path: vLLM's FlashAttention on a `[L][2, NB, bs, Hkv, D]` cache.

    UNTESTED HERE (no GPU on the build box); it is import-safe and shares the interface and the
    server with the CPU path, which the tests exercise.
    """

    supports_lse = True
    block_dim = 1

    def __init__(self, geometry: Geometry, num_blocks: int, device: str = "cuda"):
        super().__init__(geometry, num_blocks)
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401  (fail early)

        g = geometry
        if not g.plain:  # FlashAttention has these variants; wiring them is untested without a GPU
            raise NotImplementedError("the GPU attention kernel computes plain attention only (no window, "
                                      "soft-cap, ALiBi, sinks or fp8 KV cache): not wired here, no GPU to test it")
        self.device = torch.device(device)
        self.caches = [
            torch.zeros(2, num_blocks, g.block_size, g.num_kv_heads, g.head_size,
                        dtype=g.torch_dtype, device=self.device)
            for _ in range(g.num_layers)
        ]

    def prepare(self, meta, sched_window=-1):
        qsl = meta.query_start_loc.to(self.device)
        return types.SimpleNamespace(
            qsl=qsl, seq_lens=meta.seq_lens.to(self.device), bt=meta.block_table.to(self.device),
            slots=meta.slot_mapping.to(self.device), max_q=int((meta.query_start_loc.diff()).max()),
            max_k=int(meta.seq_lens.max()),
        )

    def write_kv(self, layer, key, value, meta):
        from vllm import _custom_ops as ops

        c = self.caches[layer]
        one = torch.ones((), device=self.device)
        ops.reshape_and_cache_flash(key.to(self.device), value.to(self.device), c[0], c[1],
                                    meta.slot_mapping.to(self.device), "auto", one, one)

    def attend(self, layer, query, meta, state, scale, out):
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        c = self.caches[layer]
        res = flash_attn_varlen_func(
            q=query.to(self.device), k=c[0], v=c[1], cu_seqlens_q=state.qsl, max_seqlen_q=state.max_q,
            seqused_k=state.seq_lens, max_seqlen_k=state.max_k, softmax_scale=scale, causal=True,
            block_table=state.bt,
        )
        out.copy_(res)

    def attend_prev(self, layer, query, meta, scale):
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        c = self.caches[layer]
        r = meta.num_reqs
        qsl = torch.arange(r + 1, dtype=torch.int32, device=self.device)
        ctx = (meta.seq_lens - 1).to(self.device)
        res, lse = flash_attn_varlen_func(
            q=query.to(self.device), k=c[0], v=c[1], cu_seqlens_q=qsl, max_seqlen_q=1, seqused_k=ctx,
            max_seqlen_k=max(1, int(ctx.max())), softmax_scale=scale, causal=False,
            block_table=meta.block_table.to(self.device), return_softmax_lse=True,
        )
        lse = torch.where(ctx[None, :] > 0, lse, torch.full_like(lse, float("-inf")))
        return res.cpu(), lse.transpose(0, 1).float().cpu()


class TorchPagedKernel(AttentionKernel):
    """Plain torch on a `[L][2, NB, bs, Hkv, D]` cache, on `device` (default: CUDA when present).

    `attend` runs torch SDPA (causal within the new tokens; decode-only steps in one batched call);
    `attend_prev` is float32 math with the LSE. Exact to the dtype's rounding, not tuned: it exists so
    the server runs, and can be checked, where no vLLM kernel is installed."""

    supports_lse = True
    block_dim = 1

    def __init__(self, geometry: Geometry, num_blocks: int, device: str | None = None):
        super().__init__(geometry, num_blocks)
        g = geometry
        if not g.plain:  # windows, soft-cap, ALiBi, sinks and fp8 caches are vLLM's CPU kernel's (--kernel cpu)
            raise NotImplementedError("the torch attention kernel computes plain attention only (no window, "
                                      "soft-cap, ALiBi, sinks or fp8 KV cache); use --kernel cpu for this model")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.caches = [torch.zeros(2, num_blocks, g.block_size, g.num_kv_heads, g.head_size,
                                   dtype=g.torch_dtype, device=self.device) for _ in range(g.num_layers)]

    def prepare(self, meta, sched_window=-1):
        qsl = meta.query_start_loc.tolist()
        return types.SimpleNamespace(qsl=qsl, seq_lens=meta.seq_lens.tolist(), bt=meta.block_table.to(self.device),
                                     decode=all(b - a == 1 for a, b in zip(qsl, qsl[1:])))

    def write_kv(self, layer, key, value, meta):
        g, c = self.geometry, self.caches[layer]
        slots = meta.slot_mapping.to(self.device).long()
        keep = slots >= 0  # padding tokens carry slot -1
        for half, src in ((0, key), (1, value)):
            c[half].view(-1, g.num_kv_heads, g.head_size)[slots[keep]] = src.to(self.device)[keep]

    def _kv(self, layer: int, block_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [Hkv, length, D] of one request (its first ceil(length / bs) blocks, gathered)."""
        g = self.geometry
        n = max(1, -(-length // g.block_size))
        k, v = self.caches[layer][:, block_row[:n].long()].flatten(1, 2)[:, :length].unbind(0)
        return k.transpose(0, 1), v.transpose(0, 1)

    def attend(self, layer, query, meta, state, scale, out):
        import torch.nn.functional as F

        q_all = query.to(self.device)
        if state.decode:
            out.copy_(self._attend_decode(layer, q_all, state, scale))
            return
        for r, length in enumerate(state.seq_lens):
            lo, hi = state.qsl[r], state.qsl[r + 1]
            k, v = self._kv(layer, state.bt[r], length)
            q = q_all[lo:hi].transpose(0, 1)  # [H, n, D]
            # query i (position length - n + i) sees keys 0 .. length - n + i
            mask = torch.ones(hi - lo, length, dtype=torch.bool, device=self.device).tril(length - (hi - lo))
            res = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                 enable_gqa=True)
            out[lo:hi].copy_(res[0].transpose(0, 1))

    def _attend_decode(self, layer: int, q: torch.Tensor, state, scale: float) -> torch.Tensor:
        import torch.nn.functional as F

        g = self.geometry
        longest = max(state.seq_lens)
        n = max(1, -(-longest // g.block_size))
        k, v = self.caches[layer][:, state.bt[:, :n].long()].flatten(2, 3)[:, :, :longest].unbind(0)
        lengths = torch.tensor(state.seq_lens, device=self.device)
        mask = (torch.arange(longest, device=self.device)[None, :] < lengths[:, None])[:, None, None, :]
        res = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=scale, enable_gqa=True)
        return res[:, :, 0]

    def attend_prev(self, layer, query, meta, scale):
        from vllm_disagg.attention.merge import partial_attention

        g = self.geometry
        ctx = (meta.seq_lens.long() - 1).to(self.device)
        longest = max(1, int(ctx.max()))
        n = -(-longest // g.block_size)
        k, v = self.caches[layer][:, meta.block_table[:, :n].long().to(self.device)].flatten(2, 3).unbind(0)
        present = torch.arange(n * g.block_size, device=self.device)[None, :] < ctx[:, None]
        out, lse = partial_attention(query.to(self.device), k, v, scale, key_mask=present)
        return out.cpu(), lse.float().cpu()


class NullKernel(AttentionKernel):
    """No attention at all: the reply is the session's output buffer as it stands. Only for
    measuring the per-layer exchange's transport round trip through the real client and server
    code (framing, checks, metadata, metrics), i.e. what Lamina's 33 us figure measures. Never
    for serving: its outputs are garbage."""

    def prepare(self, meta, sched_window=-1):
        return None

    def write_kv(self, layer, key, value, meta):
        pass

    def attend(self, layer, query, meta, state, scale, out):
        pass


def preload(kind: str) -> None:
    """Import the kernel's vLLM modules now (seconds on a busy box), not inside the first INIT."""
    if kind == "cpu":
        import vllm.v1.attention.backends.cpu_attn  # noqa: F401
        from vllm import _custom_ops  # noqa: F401


def make_kernel(kind: str, geometry: Geometry, num_blocks: int) -> AttentionKernel:
    if kind == "cpu":
        return CpuAttentionKernel(geometry, num_blocks)
    if kind == "cuda":
        return FlashAttentionKernel(geometry, num_blocks)
    if kind == "torch":
        return TorchPagedKernel(geometry, num_blocks)
    if kind == "none":
        return NullKernel(geometry, num_blocks)
    raise ValueError(f"unknown attention kernel {kind!r}; expected 'cpu', 'cuda', 'torch' or 'none' (benchmarks only)")
