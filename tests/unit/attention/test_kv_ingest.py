# SPDX-License-Identifier: Apache-2.0
"""Prefill -> attention server KV pushes: head slices of prefill blocks land in each server's own blocks
(real tcp/shm transports on 127.0.0.1), landing is counted per transfer, bad polls are refused."""

from __future__ import annotations

import time

import pytest
import torch

from vllm_disagg.attention.kv_ingest import KVIngest
from vllm_disagg.kv.push_plan import shard_writes as _shard_writes
from vllm_disagg.kv.register_body import encode_targets
from vllm_disagg.kv.register_body import parse_targets as _targets
from vllm_disagg.transport import BlockWrite, TransportOptions, get_transport

TOKEN = "ingest-token"
NB, H, BS, D2, LAYERS = 6, 4, 8, 16, 2  # prefill cache [NB, H, BS, 2*head_dim] per layer


def _wait_landed(ingest: KVIngest, tid: str, nbytes: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while ingest.landed([tid])[tid] < nbytes:
        assert time.monotonic() < deadline, ingest.landed([tid])
        time.sleep(0.005)


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_head_slices_of_prefill_blocks_land_in_each_servers_blocks_and_are_counted(kind):
    prefill = [torch.randn(NB, H, BS, D2) for _ in range(LAYERS)]
    num_servers = 2
    servers = [[torch.zeros(NB, H // num_servers, BS, D2) for _ in range(LAYERS)] for _ in range(num_servers)]
    ingests = [KVIngest(kind, TOKEN) for _ in servers]
    sender = get_transport(kind, TransportOptions(auth_token=TOKEN)).kv_sender(name="prefill")
    try:
        addrs = [ing.attach(caches) for ing, caches in zip(ingests, servers, strict=True)]
        wire = encode_targets([(a, num_servers, i) for i, a in enumerate(addrs)])
        targets = _targets({"address": "d", "targets": wire}, H)  # what P parses from D's REGISTER
        src_blocks, dst_blocks = [1, 4, 5], [0, 3, 2]
        for address, n, shard in targets:
            peer = sender.connect(address, timeout=10)
            for layer in range(LAYERS):
                writes = [BlockWrite(str(layer), prefill[layer], src_blocks, dst_blocks)]
                peer.write_blocks(_shard_writes(writes, n, shard), "tid-1", layer).wait(10)
        per_server = LAYERS * len(src_blocks) * (H // num_servers) * BS * D2 * 4
        for s, ing in enumerate(ingests):
            _wait_landed(ing, "tid-1", per_server)
            heads = slice(s * H // num_servers, (s + 1) * H // num_servers)
            for layer in range(LAYERS):
                for src, dst in zip(src_blocks, dst_blocks, strict=True):
                    assert torch.equal(servers[s][layer][dst], prefill[layer][src, heads])
                assert servers[s][layer][1].abs().sum() == 0  # untouched blocks stay untouched
        assert ingests[0].landed(["tid-1"], forget=True) == {"tid-1": per_server}
        assert ingests[0].landed(["tid-1"]) == {"tid-1": -1}
        assert ingests[1].bytes_landed._value.get() == per_server
    finally:
        sender.close()
        for ing in ingests:
            ing.close()


def test_whole_block_targets_and_the_plain_pd_default_send_unsliced_blocks():
    src = torch.randn(NB, H, BS, D2)
    w = [BlockWrite("0", src, [2], [5])]
    assert _shard_writes(w, 1, 0) is w
    assert _targets({"address": "127.0.0.1:9"}, H) == (("127.0.0.1:9", 1, 0),)
    [sliced] = _shard_writes(w, 4, 3)
    assert torch.equal(sliced.src[sliced.src_block_ids[0]].view(BS, D2), src[2, 3])


@pytest.mark.parametrize("bad", ["a,3,0", "a,2,2", "a,2", "a", "", ",2,0", "a,0,0", "a,x,0", ["a", 2, 0],
                                 ";".join(["a,1,0"] * 65)])
def test_registrations_with_targets_that_do_not_split_the_kv_heads_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        _targets({"address": "d", "targets": bad}, H)


@pytest.mark.parametrize("path", ["/kv/landed?ids=" + "x" * 65, "/kv/landed?ids=a/b", "/kv/landed?ids="
                                  + ",".join(str(i) for i in range(300))])
def test_malformed_landing_polls_are_refused(path):
    ing = KVIngest("tcp", TOKEN)
    try:
        with pytest.raises(ValueError):
            ing.http_landed(path)
        assert ing.http_landed("/kv/landed?ids=ab-1,cd_2") == {"ab-1": -1, "cd_2": -1}
    finally:
        ing.close()


def test_the_fence_endpoint_wants_the_token_and_well_formed_ids():
    """`POST /kv/fence` changes what lands: a stranger gets 401, malformed ids 400, a fence of a push
    with nothing in flight answers true at once."""
    import urllib.error
    import urllib.request

    from vllm_disagg.attention import queries
    from vllm_disagg.attention.server import DisaggAttentionServer

    server = DisaggAttentionServer(transport="tcp", kv_cache_bytes=1 << 20, auth_token=TOKEN, kv_transport="tcp")
    http = server.start()["http"]
    try:
        for path, headers, status in (("/kv/fence?ids=ab", {}, 401),
                                      ("/kv/fence?ids=a/b", {"Authorization": f"Bearer {TOKEN}"}, 400)):
            req = urllib.request.Request(f"http://{http}{path}", headers=headers, method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=5)
            assert err.value.code == status
        assert queries.fence(http, ["ab-1", "cd_2"], TOKEN, 5.0) is True
    finally:
        server.stop()


def test_push_counts_nobody_collects_are_reclaimed_after_the_ttl_and_past_the_cap(monkeypatch):
    """The decode worker that should collect a push's count died (or cancelled the push): the server
    does not keep the count forever."""
    from types import SimpleNamespace

    from vllm_disagg.attention import kv_ingest

    ing = KVIngest("tcp", TOKEN, ttl_s=0.2)
    try:
        ing._count([SimpleNamespace(transfer_id="orphan", nbytes=64)])
        assert ing.landed(["orphan"]) == {"orphan": 64} and len(ing._landed) == 1
        time.sleep(0.3)
        ing._gc(time.monotonic())
        assert ing.landed(["orphan"]) == {"orphan": -1} and ing.num_reclaimed == 1
        monkeypatch.setattr(kv_ingest, "_MAX_ENTRIES", 3)
        ing._count([SimpleNamespace(transfer_id=f"t{i}", nbytes=1) for i in range(5)])
        ing._gc(time.monotonic())
        assert sorted(ing._landed) == ["t2", "t3", "t4"]  # the oldest went first
    finally:
        ing.close()


def test_an_advertised_address_stands_in_front_of_the_receiver_and_pushes_through_it_land():
    """`attn-server --kv-advertise`: /health's kv_address is the proxy prefill connects to, and
    kv_listen_address the receiver behind it (the chaos campaign's Lamina links, testing/chaos/links.py)."""
    from vllm_disagg.launch.local import free_ports
    from vllm_disagg.testing.throttle import ThrottledProxy

    port = free_ports(1)[0]
    ingest = KVIngest("tcp", TOKEN, advertise=f"127.0.0.1:{port}")
    caches = [torch.zeros(NB, H, BS, D2) for _ in range(LAYERS)]
    sender = get_transport("tcp", TransportOptions(auth_token=TOKEN)).kv_sender(name="prefill")
    proxy = None
    try:
        assert ingest.attach(caches) == f"127.0.0.1:{port}"
        info = ingest.info()
        assert info["kv_address"] == f"127.0.0.1:{port}" and info["kv_listen_address"] != info["kv_address"]
        proxy = ThrottledProxy(info["kv_listen_address"], None, port=port)
        src = torch.randn(NB, H, BS, D2)
        sender.connect(info["kv_address"], timeout=10).write_blocks([BlockWrite("0", src, [2], [5])], "tid-a", 0).wait(10)
        _wait_landed(ingest, "tid-a", H * BS * D2 * 4)
        assert torch.equal(caches[0][5], src[2]) and proxy.num_forwarded > 0
    finally:
        sender.close()
        ingest.close()
        if proxy is not None:
            proxy.close()
    with pytest.raises(ValueError, match="needs --kv-transport tcp"):
        KVIngest("shm", TOKEN, advertise="127.0.0.1:9")
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        KVIngest("tcp", TOKEN, advertise="nowhere")
