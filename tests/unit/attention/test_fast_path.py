# SPDX-License-Identifier: Apache-2.0
"""The per-layer hot path: one shm server with spinning rings (the reply lands straight in vLLM's
output tensor), byte views of tensors, the header tuple, and the benchmark-only null kernel."""

from __future__ import annotations

import pytest
import torch

from vllm_disagg.attention import wire
from vllm_disagg.attention.client import AttentionServerLost, ClientMeta, DisaggAttentionClient
from vllm_disagg.attention.merge import partial_attention
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.errors import ProtocolError

TOKEN = "unit-token"
GEOM = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_size=32, block_size=32, dtype="float32",
            max_num_tokens=64)


def _meta(lengths: list[int], new: list[int], first_blocks: list[int]) -> ClientMeta:
    """Requests with `lengths` tokens already cached and `new` tokens this step, one block run each."""
    cols = max(-(-(n + m) // 32) for n, m in zip(lengths, new))
    table = torch.stack([torch.arange(b, b + cols, dtype=torch.int32) for b in first_blocks])
    slots = torch.cat([table[r, (torch.arange(n, n + m) // 32)].long() * 32 + torch.arange(n, n + m) % 32
                       for r, (n, m) in enumerate(zip(lengths, new))])
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    step = wire.StepMeta(qsl, torch.tensor([n + m for n, m in zip(lengths, new)], dtype=torch.int32), table, slots)
    return ClientMeta(step, max_query_len=max(new), num_actual_tokens=sum(new))


@pytest.fixture(scope="module")
def shm_server():
    srv = DisaggAttentionServer(transport="shm", kv_cache_bytes=4 << 20, auth_token=TOKEN, spin_us=50.0)
    info = srv.start()
    yield srv, info
    srv.stop()


def test_one_spinning_shm_server_answers_exact_attention_straight_into_the_output(shm_server):
    _, info = shm_server
    client = DisaggAttentionClient([info["http"]], transport="shm", send_q_early=False, auth_token=TOKEN,
                                   spin_us=50.0)
    client.connect(**GEOM)
    lengths, keys, values = [33, 50], [], []
    for i, n in enumerate(lengths):
        k, v = torch.randn(n, 2, 32), torch.randn(n, 2, 32)
        client.attend(0, torch.randn(n, 4, 32), k, v, _meta([0], [n], [1 + 4 * i]), 0.2, torch.empty(n, 4, 32))
        keys.append(k)
        values.append(v)
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    out = torch.full((2, 4, 32), float("nan"))
    pend = client.submit(0, q, k, v, _meta(lengths, [1, 1], [1, 5]), 0.2)
    assert pend.wait(out) is out
    strided = torch.empty(4, 2, 32).transpose(0, 1)  # not contiguous: the general path copies into it
    client.attend(0, q, k, v, _meta(lengths, [1, 1], [1, 5]), 0.2, strided)
    for r in range(2):
        kk, vv = torch.cat([keys[r], k[r : r + 1]])[None], torch.cat([values[r], v[r : r + 1]])[None]
        ref, _ = partial_attention(q[r : r + 1], kk, vv, 0.2)
        torch.testing.assert_close(out[r], ref[0], atol=1e-5, rtol=1e-4)
    client.close()


def test_an_error_reply_on_the_direct_path_raises_instead_of_passing_as_output(shm_server):
    _, info = shm_server
    client = DisaggAttentionClient([info["http"]], transport="shm", send_q_early=False, auth_token=TOKEN)
    client.connect(**GEOM)
    n = GEOM["max_num_tokens"] + 1  # beyond the INIT geometry: the server answers ERROR
    with pytest.raises(AttentionServerLost, match="outside the INIT geometry"):
        client.attend(0, torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32),
                      _meta([0], [n], [1]), 0.2, torch.empty(n, 4, 32))
    client.close()


def test_the_null_kernel_server_runs_the_whole_exchange_without_computing():
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=1 << 20, kernel="none", auth_token=TOKEN)
    info = srv.start()
    try:
        client = DisaggAttentionClient([info["http"]], transport="tcp", send_q_early=False, auth_token=TOKEN)
        client.connect(**GEOM)
        out = torch.empty(8, 4, 32)
        client.attend(1, torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32),
                      _meta([0], [8], [1]), 0.2, out)
        assert srv.kernel.supports_lse is False and type(srv.kernel).__name__ == "NullKernel"
        client.close()
    finally:
        srv.stop()


def test_byte_view_is_the_tensor_memory_and_refuses_strided_tensors():
    t = torch.randn(3, 5)
    view = wire.byte_view(t)
    assert view.format == "B" and view.nbytes == t.nbytes and bytes(view) == t.numpy().tobytes()
    view[:4] = bytes(4)  # writes land in the tensor itself (no copy)
    assert t[0, 0].item() == 0.0
    assert wire.byte_view(torch.empty(0)).nbytes == 0
    with pytest.raises(ValueError, match="contiguous"):
        wire.byte_view(t.t())


def test_header_round_trips_and_rejects_another_version():
    h = wire.Header(wire.ATTN, seq=7, flags=wire.HAS_META, layer=3, meta_id=9, num_tokens=5, num_reqs=2,
                    num_cols=4, scale=0.5)
    back = wire.unpack_header(h.pack())
    assert back == h and back.has_meta
    raw = bytearray(h.pack())
    raw[4:6] = (wire.PROTOCOL_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(ProtocolError, match="version"):
        wire.unpack_header(bytes(raw))
    with pytest.raises(ProtocolError, match="unknown message type"):
        wire.unpack_header(wire.Header(99).pack())


def test_a_decode_layer_moves_2_plus_2_over_g_times_d_times_e_bytes_per_token(shm_server):
    """Lamina's per-token, per-layer traffic: q and the attention output (d each) plus k and v
    (d/G each), e bytes per element; counted by the server's own byte counters."""
    srv, info = shm_server
    client = DisaggAttentionClient([info["http"]], transport="shm", send_q_early=False, auth_token=TOKEN)
    client.connect(**GEOM)
    tokens, d, group, e = 3, GEOM["num_heads"] * GEOM["head_size"], GEOM["num_heads"] // GEOM["num_kv_heads"], 4
    meta = _meta([5, 9, 20], [1, 1, 1], [1, 3, 5])

    def layer() -> None:
        client.attend(1, torch.randn(tokens, 4, 32), torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32), meta,
                      0.2, torch.empty(tokens, 4, 32))

    def counted() -> float:
        conn = client.conns[0]  # a PING answered in order: the server finished counting the layer before
        conn.recv(conn.send(wire.PING, []), wire.PONG)
        reg = srv.metrics.registry
        return sum(reg.get_sample_value(f"vllm:disagg_attention_bytes_{x}_total") for x in ("in", "out"))

    layer()  # carries the step metadata
    before = counted()
    layer()
    moved = counted() - before
    assert moved / tokens == (2 + 2 / group) * d * e
    client.close()
