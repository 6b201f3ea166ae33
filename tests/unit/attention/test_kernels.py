# SPDX-License-Identifier: Apache-2.0
"""The server's CPU kernel wrapper: vLLM's CPU attention on a shard, and the LSE read-back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from vllm_disagg.attention.kernels import CpuAttentionKernel
from vllm_disagg.attention.merge import merge_attn_states, partial_attention
from vllm_disagg.attention.wire import Geometry, StepMeta


def _setup(lengths, hq=4, hkv=2, d=32, bs=32):
    g = Geometry(num_layers=2, num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=bs,
                 dtype="float32", max_num_tokens=512)
    kern = CpuAttentionKernel(g, num_blocks=16)
    cols = max(-(-(n + 1) // bs) for n in lengths)  # room for one decode token
    table = torch.zeros(len(lengths), cols, dtype=torch.int32)
    next_block = 1
    for r, n in enumerate(lengths):  # non-contiguous, descending block ids
        for c in range(-(-(n + 1) // bs)):
            table[r, c] = 15 - next_block
            next_block += 1
    return g, kern, table


def _prefill_meta(lengths, table, bs):
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.cat([
        table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for r, n in enumerate(lengths)
    ])
    return StepMeta(qsl, torch.tensor(lengths, dtype=torch.int32), table, slots)


def test_cpu_kernel_prefill_matches_reference_attention_per_request():
    lengths = [40, 7, 70]
    g, kern, table = _setup(lengths)
    meta = _prefill_meta(lengths, table, g.block_size)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 32) for h in (4, 2, 2))
    kern.write_kv(1, k, v, meta)
    out = torch.empty(t, 4, 32)
    kern.attend(1, q, meta, kern.prepare(meta), 0.2, out)
    start = 0
    for n in lengths:  # causal: the last token of each request sees all of it
        ref, _ = partial_attention(q[None, start + n - 1], k[None, start:start + n], v[None, start:start + n], 0.2)
        torch.testing.assert_close(out[start + n - 1], ref[0], atol=1e-5, rtol=1e-4)
        start += n


def test_prev_attention_merged_with_the_new_token_equals_the_kernels_full_attention():
    lengths = [33, 1, 64]
    g, kern, table = _setup(lengths)
    assert kern.supports_lse
    meta = _prefill_meta(lengths, table, g.block_size)
    t = sum(lengths)
    kern.write_kv(0, torch.randn(t, 2, 32), torch.randn(t, 2, 32), meta)
    # decode step: one new token per request at position n
    seq = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
    slots = torch.tensor([int(table[r, n // 32]) * 32 + n % 32 for r, n in enumerate(lengths)])
    dmeta = StepMeta(torch.arange(4, dtype=torch.int32), seq, table, slots)
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    a_prev, lse_prev = kern.attend_prev(0, q, dmeta, 0.17)
    a_new, lse_new = partial_attention(q, k[:, None], v[:, None], 0.17)
    merged, _ = merge_attn_states(a_prev, lse_prev, a_new, lse_new)
    kern.write_kv(0, k, v, dmeta)
    full = torch.empty(3, 4, 32)
    kern.attend(0, q, dmeta, kern.prepare(dmeta), 0.17, full)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-4)


def test_a_fresh_process_runs_the_bf16_kernel_without_any_matmul_before_it():
    """On AMX CPUs vLLM picks its AMX kernel for bfloat16; the process must have asked Linux for AMX
    state first (a vLLM engine's oneDNN matmuls do, a server does not): SIGILL otherwise."""
    code = textwrap.dedent("""
        import torch
        from vllm_disagg.attention.kernels import CpuAttentionKernel
        from vllm_disagg.attention.wire import Geometry, StepMeta
        g = Geometry(num_layers=1, num_heads=4, num_kv_heads=2, head_size=64, block_size=128,
                     dtype="bfloat16", max_num_tokens=512)
        kern = CpuAttentionKernel(g, num_blocks=4)
        meta = StepMeta(torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                        torch.tensor([[1]], dtype=torch.int32), torch.arange(128, 168))
        q, k, v = (torch.randn(40, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
        kern.write_kv(0, k, v, meta)
        out = torch.empty(40, 4, 64, dtype=torch.bfloat16)
        kern.attend(0, q, meta, kern.prepare(meta), 0.125, out)
        assert torch.isfinite(out.float()).all()
        print("isa", kern.isa)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
