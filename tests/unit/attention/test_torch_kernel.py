# SPDX-License-Identifier: Apache-2.0
"""`TorchPagedKernel` (plain torch, the GPU kit's kernel where no vLLM is installed) against vLLM's
CPU kernel on the same writes, and its LSE half merged with the new token against its full attention.
On the lent GPU the same class runs on CUDA (`benchmarks/gpu/lamina_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from vllm_disagg.attention.kernels import CpuAttentionKernel, TorchPagedKernel, make_kernel
from vllm_disagg.attention.merge import merge_attn_states, partial_attention
from vllm_disagg.attention.wire import Geometry, StepMeta

BS, HQ, HKV, D = 16, 4, 2, 32
TOKEN = "unit-token"


def _geometry() -> Geometry:
    return Geometry(num_layers=2, num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS, dtype="float32",
                    max_num_tokens=512)


def _table(lengths: list[int]) -> torch.Tensor:
    cols = max(-(-(n + 1) // BS) for n in lengths)
    table = torch.zeros(len(lengths), cols, dtype=torch.int32)
    block = 30
    for r, n in enumerate(lengths):  # scattered, descending block ids
        for c in range(-(-(n + 1) // BS)):
            table[r, c] = block
            block -= 1
    return table


def _chunk_meta(lengths: list[int], done: list[int], table: torch.Tensor) -> StepMeta:
    """A step that adds tokens done[r] .. lengths[r] - 1 of each request (prefill or a later chunk)."""
    new = [n - d for n, d in zip(lengths, done)]
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.cat([table[r, torch.arange(d, n) // BS].long() * BS + torch.arange(d, n) % BS
                       for r, (n, d) in enumerate(zip(lengths, done))])
    return StepMeta(qsl, torch.tensor(lengths, dtype=torch.int32), table, slots)


@pytest.fixture
def kernels():
    return CpuAttentionKernel(_geometry(), num_blocks=32), TorchPagedKernel(_geometry(), num_blocks=32, device="cpu")


def test_make_kernel_torch_runs_without_a_gpu_on_cpu():
    assert make_kernel("torch", _geometry(), 4).device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_prefill_chunks_and_a_decode_step_match_vllms_cpu_kernel(kernels):
    lengths, first = [40, 7, 70], [25, 7, 33]
    table = _table(lengths)
    steps = [_chunk_meta(first, [0, 0, 0], table), _chunk_meta(lengths, first, table),
             _chunk_meta([n + 1 for n in lengths], lengths, table)]  # chunked prefill, then one decode token
    for meta in steps:
        t = int(meta.query_start_loc[-1])
        q, k, v = (torch.randn(t, h, D) for h in (HQ, HKV, HKV))
        outs = []
        for kern in kernels:
            kern.write_kv(1, k, v, meta)
            out = torch.full((t, HQ, D), float("nan"))
            kern.attend(1, q, meta, kern.prepare(meta), 0.2, out)
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)


def test_prev_attention_merged_with_the_new_token_equals_full_attention():
    kern = TorchPagedKernel(_geometry(), num_blocks=32, device="cpu")
    lengths = [33, 1, 64]
    table = _table(lengths)
    meta = _chunk_meta(lengths, [0, 0, 0], table)
    t = sum(lengths)
    kern.write_kv(0, torch.randn(t, HKV, D), torch.randn(t, HKV, D), meta)
    dmeta = _chunk_meta([n + 1 for n in lengths], lengths, table)
    q, k, v = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    a_prev, lse_prev = kern.attend_prev(0, q, dmeta, 0.17)
    a_new, lse_new = partial_attention(q, k[:, None], v[:, None], 0.17)
    merged, _ = merge_attn_states(a_prev, lse_prev, a_new, lse_new)
    kern.write_kv(0, k, v, dmeta)
    full = torch.empty(3, HQ, D)
    kern.attend(0, q, dmeta, kern.prepare(dmeta), 0.17, full)
    torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def torch_servers():
    from vllm_disagg.attention.server import DisaggAttentionServer

    both = [DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, kernel="torch", auth_token=TOKEN)
            for _ in range(2)]
    infos = [s.start() for s in both]
    yield [info["http"] for info in infos]
    for s in both:
        s.stop()


@pytest.mark.parametrize(("partition", "early"), [("head", False), ("head", True), ("request", False)])
def test_servers_on_the_torch_kernel_answer_exact_attention_through_the_client(torch_servers, partition, early):
    """What the GPU kit's step c runs on the lent GPU (there in server processes, on CUDA)."""
    from test_server import GEOM, _decode_meta, _prefill_meta

    from vllm_disagg.attention.client import DisaggAttentionClient

    client = DisaggAttentionClient(torch_servers, transport="tcp", partition=partition, send_q_early=early,
                                   auth_token=TOKEN)
    assert client.connect(**GEOM) > 0
    lengths, metas, keys, values = [40, 70], [], [], []
    for i, n in enumerate(lengths):
        meta = _prefill_meta(n, 1 + 4 * i)
        k, v = torch.randn(n, 2, 32), torch.randn(n, 2, 32)
        client.attend(1, torch.randn(n, 4, 32), k, v, meta, 0.2, torch.empty(n, 4, 32))
        metas.append(meta)
        keys.append(k)
        values.append(v)
    dmeta = _decode_meta(lengths, [m.step.block_table for m in metas])
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    out = torch.full((2, 4, 32), float("nan"))
    client.attend(1, q, k, v, dmeta, 0.2, out)
    for r in range(2):
        ref, _ = partial_attention(q[r:r + 1], torch.cat([keys[r], k[r:r + 1]])[None],
                                   torch.cat([values[r], v[r:r + 1]])[None], 0.2)
        torch.testing.assert_close(out[r], ref[0], atol=1e-5, rtol=1e-4)
    client.close()
