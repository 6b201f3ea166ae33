# SPDX-License-Identifier: Apache-2.0
"""The attention server over a real transport (in-process threads): answers, rejects bad frames
and keeps serving, exposes /health and /metrics; the client's partitioning round-trips."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from vllm_disagg.attention import wire
from vllm_disagg.attention.client import AttentionServerLost, ClientMeta, DisaggAttentionClient
from vllm_disagg.attention.merge import partial_attention
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.transport import TransportOptions, get_transport

TOKEN = "unit-token"
GEOM = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_size=32, block_size=32, dtype="float32",
            max_num_tokens=256)


@pytest.fixture(scope="module")
def servers():
    both = [DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN) for _ in range(2)]
    infos = [s.start() for s in both]
    yield list(zip(both, infos))
    for s in both:
        s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def _prefill_meta(length: int, first_block: int) -> ClientMeta:
    nblk = -(-(length + 1) // 32)
    table = torch.arange(first_block, first_block + nblk, dtype=torch.int32)[None]
    slots = table[0, torch.arange(length) // 32].long() * 32 + torch.arange(length) % 32
    step = wire.StepMeta(torch.tensor([0, length], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                         table, slots)
    return ClientMeta(step, max_query_len=length, num_actual_tokens=length)


def _decode_meta(lengths: list[int], tables: list[torch.Tensor]) -> ClientMeta:
    cols = max(t.shape[1] for t in tables)
    table = torch.zeros(len(lengths), cols, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : t.shape[1]] = t[0]
    slots = torch.tensor([int(table[r, n // 32]) * 32 + n % 32 for r, n in enumerate(lengths)])
    step = wire.StepMeta(torch.arange(len(lengths) + 1, dtype=torch.int32),
                         torch.tensor([n + 1 for n in lengths], dtype=torch.int32), table, slots)
    return ClientMeta(step, max_query_len=1, num_actual_tokens=len(lengths))


@pytest.mark.parametrize(("partition", "early"), [("head", False), ("head", True), ("request", True)])
def test_client_and_server_compute_exact_attention_for_prefill_then_decode(servers, partition, early):
    client = DisaggAttentionClient([info["http"] for _, info in servers],
                                   transport="tcp", partition=partition, send_q_early=early, auth_token=TOKEN)
    assert client.connect(**GEOM) > 0
    lengths, metas, keys, values = [40, 70], [], [], []
    for i, n in enumerate(lengths):  # two requests, prefilled separately, in distinct blocks
        meta = _prefill_meta(n, 1 + 4 * i)
        k, v = torch.randn(n, 2, 32), torch.randn(n, 2, 32)
        client.attend(1, torch.randn(n, 4, 32), k, v, meta, 0.2, torch.empty(n, 4, 32))
        metas.append(meta)
        keys.append(k)
        values.append(v)
    dmeta = _decode_meta(lengths, [m.step.block_table for m in metas])
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    out = torch.empty(2, 4, 32)
    client.attend(1, q, k, v, dmeta, 0.2, out)
    for r in range(2):
        kk = torch.cat([keys[r], k[r : r + 1]])[None]
        vv = torch.cat([values[r], v[r : r + 1]])[None]
        ref, _ = partial_attention(q[r : r + 1], kk, vv, 0.2)
        torch.testing.assert_close(out[r], ref[0], atol=1e-5, rtol=1e-4)
    client.close()


def test_bad_frames_get_an_error_reply_and_the_server_keeps_serving(server):
    srv, info = server
    tr = get_transport("tcp", TransportOptions(auth_token=TOKEN))
    ch = tr.connect_msg(info["address"], timeout=5)

    def ask(header: bytes, tensors) -> wire.Header:
        ch.send(header, tensors)
        return wire.unpack_header(ch.recv(timeout=5).header)

    assert ask(b"garbage", []).mtype == wire.ERROR
    assert ask(wire.Header(wire.ATTN, seq=1).pack(), []).mtype == wire.ERROR  # no INIT yet
    assert ask(wire.Header(wire.INIT, seq=2).pack(), [b"{not json"]).mtype == wire.ERROR
    geom = wire.Geometry(**GEOM)
    assert ask(wire.Header(wire.INIT, seq=3).pack(), [geom.to_json()]).mtype == wire.INIT_OK
    meta = _prefill_meta(8, 1)
    q, k, v = torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    hdr = wire.Header(wire.ATTN, seq=4, flags=wire.HAS_META, layer=0, meta_id=7, num_tokens=8, num_reqs=1,
                      num_cols=1, scale=0.1)
    bad_table = wire.StepMeta(meta.step.query_start_loc, meta.step.seq_lens,
                              torch.tensor([[10**6]], dtype=torch.int32), meta.step.slot_mapping)
    assert ask(hdr.pack(), [q, k, v, *bad_table.tensors()]).mtype == wire.ERROR  # block id out of range
    assert ask(hdr.pack(), [q[:4], k, v, *meta.step.tensors()]).mtype == wire.ERROR  # short q
    unknown = wire.Header(wire.ATTN, seq=5, layer=0, meta_id=99, num_tokens=8, scale=0.1)
    assert ask(unknown.pack(), [q, k, v]).mtype == wire.ERROR  # metadata never sent
    assert ask(wire.Header(wire.PING, seq=6).pack(), []).mtype == wire.PONG
    assert ask(hdr.pack(), [q, k, v, *meta.step.tensors()]).mtype == wire.OUT
    ch.close()


def test_health_and_metrics_endpoints_report_the_shard(server):
    srv, info = server
    with urllib.request.urlopen(f"http://{info['http']}/health", timeout=5) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["address"] == info["address"]
    with urllib.request.urlopen(f"http://{info['http']}/metrics", timeout=5) as r:
        text = r.read().decode()
    for name in ("layer_seconds", "bytes_in", "bytes_out", "queue_depth", "errors"):
        assert f"vllm:disagg_attention_{name}" in text


def test_a_server_that_is_gone_raises_instead_of_hanging():
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=1 << 20, auth_token=TOKEN)
    info = srv.start()
    client = DisaggAttentionClient([info["http"]], transport="tcp", timeout_s=2.0, auth_token=TOKEN)
    client.connect(**GEOM)
    srv.stop()
    meta = _prefill_meta(8, 1)
    with pytest.raises(AttentionServerLost):
        client.attend(0, torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32), meta, 0.1,
                      torch.empty(8, 4, 32))
    client.close()


def test_head_wise_needs_the_server_count_to_divide_the_kv_heads():
    from vllm_disagg.attention.partition import head_shards

    shards = head_shards(2, 8, 2)
    assert [(s.q_heads, s.kv_heads) for s in shards] == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]
    with pytest.raises(ValueError, match="divide"):
        head_shards(3, 12, 4)


def test_request_wise_places_new_requests_on_the_least_loaded_server_and_keeps_them_there():
    from vllm_disagg.attention.partition import RequestPlacer

    placer = RequestPlacer(2)
    big, small1, small2 = _prefill_meta(100, 1), _prefill_meta(10, 20), _prefill_meta(10, 30)
    step = _concat([big, small1, small2])
    splits = placer.split(step)
    assert [sp.token_ids.numel() for sp in splits] == [100, 20]  # big alone; both small on server 1
    dec = _decode_meta([100, 10, 10], [big.step.block_table, small1.step.block_table, small2.step.block_table])
    splits = placer.split(dec.step)
    assert splits[0].meta.block_table[:, 0].tolist() == [1] and splits[1].meta.num_reqs == 2


def _concat(metas: list[ClientMeta]) -> wire.StepMeta:
    cols = max(m.step.block_table.shape[1] for m in metas)
    lens = [m.step.slot_mapping.numel() for m in metas]
    table = torch.zeros(len(metas), cols, dtype=torch.int32)
    for r, m in enumerate(metas):
        table[r, : m.step.block_table.shape[1]] = m.step.block_table[0]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return wire.StepMeta(qsl, torch.tensor(lens, dtype=torch.int32), table,
                         torch.cat([m.step.slot_mapping for m in metas]))


def test_executor_health_wait_names_the_servers_that_do_not_answer(server):
    from vllm_disagg.attention.executor import wait_healthy

    srv, info = server
    assert wait_healthy([info["http"]], timeout_s=2) == []
    assert wait_healthy([info["http"], "127.0.0.1:1"], timeout_s=0.5) == ["127.0.0.1:1"]
