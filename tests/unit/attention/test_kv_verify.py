# SPDX-License-Identifier: Apache-2.0
"""Verified prefill -> attention-server pushes (`kv.verify_checksums` with remote attention): once every
byte landed, the decode worker asks P for its checksums (one list per KV-head shard head-wise) and each
server for the same over the blocks it holds (`GET /kv/checksums`); a difference fails the push, so the
request recomputes its prompt instead of decoding from damaged KV.

Real parts on 127.0.0.1: two attention servers with their KV receivers (tcp) that a real client INITed,
the prefill side's `PushSender`, the decode side's `AttnPushReceiver`, and a proxy on one server's KV
link that flips one payload byte (no frame check sees it: the frame CRC covers header and meta)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_disagg.attention.client import DisaggAttentionClient
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.config import KVTransferSection, RemoteAttentionSection
from vllm_disagg.kv.handshake import HandshakeInfo
from vllm_disagg.kv.lamina.targets import AttnPushReceiver
from vllm_disagg.kv.metadata import DisaggConnectorMetadata, RecvSpec, SaveSpec
from vllm_disagg.kv.push_sender import PushSender
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.testing.throttle import ThrottledProxy
from vllm_disagg.transport import TransportOptions, get_transport

TOKEN = "kv-verify-token"
BS, LAYERS, KV_HEADS, HEAD, NUM_BLOCKS = 16, 2, 2, 32, 3
INFO = HandshakeInfo(model="m", dtype="float32", block_size=BS, kv_layout=f"cpu:float32({KV_HEADS}, {BS}, {2 * HEAD})",
                     num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD,
                     block_nbytes=KV_HEADS * BS * 2 * HEAD * 4)


def _tcp():
    return get_transport("tcp", TransportOptions(auth_token=TOKEN))


class Lamina:
    """Two attention servers, the model worker's client, P's sender and D's verifying receiver."""

    def __init__(self, partition: str):
        self.servers = [DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=TOKEN,
                                              kv_transport="tcp") for _ in range(2)]
        https = [s.start()["http"] for s in self.servers]
        self.client = DisaggAttentionClient(https, transport="tcp", auth_token=TOKEN, partition=partition)
        self.client.connect(num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS, head_size=HEAD, block_size=BS,
                            dtype="float32", max_num_tokens=256)
        self.layers = [torch.randn(8, KV_HEADS, BS, 2 * HEAD) for _ in range(LAYERS)]
        self.sender = PushSender(_tcp(), _tcp(), INFO, TOKEN, self.layers,
                                 KVTransferSection(push_timeout_s=20.0, layerwise_threshold_tokens=0),
                                 (DisaggKVConnectorStats(), threading.Lock()))
        ra = RemoteAttentionSection(servers=https, transport="tcp", partition=partition)
        self.stats = DisaggKVConnectorStats()
        self.receiver = AttnPushReceiver(_tcp(), INFO, TOKEN, (self.stats, threading.Lock()), "recompute", ra,
                                         placer=self.client.placer, client=lambda: self.client, verify=True)

    def push(self, transfer_id: str, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[set, set]:
        """P pushes its blocks `src` into D's blocks `dst`; (done, failed) once D decided (a failed
        receive is done too: vLLM's finished_recving)."""
        self.receiver.start([RecvSpec("d1", transfer_id, self.sender.address, dst, 0, len(dst) * BS, 20.0)])
        self.sender.bind(DisaggConnectorMetadata(save_specs=[SaveSpec("p1", src, len(src) * BS, len(src) * BS,
                                                                      transfer_id, True)]))
        for layer in range(LAYERS):
            self.sender.layer_saved(layer)
        self.sender.step_done()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, failed = self.receiver.poll()
            if done or failed:
                return done, failed
            time.sleep(0.01)
        raise AssertionError("the push was neither done nor failed in 20 s")

    def close(self) -> None:
        self.receiver.close()
        self.sender.close()
        self.client.close()
        for server in self.servers:
            server.stop()


@pytest.fixture
def lamina(request):
    deployment = Lamina(request.param)
    yield deployment
    deployment.close()


@pytest.mark.parametrize("lamina", ["head", "request"], indirect=True)
def test_a_verified_push_to_the_attention_servers_is_done_once_every_shard_matches(lamina):
    done, failed = lamina.push("fe10", (1, 2, 3), (4, 5, 6))
    assert (done, failed) == ({"d1"}, set())
    assert lamina.receiver.num_landed == 1 and lamina.stats.data["num_checksum_mismatches"] == 0
    assert not lamina.sender.plan.checksums  # D's VERIFY took P's checksums: the check ran
    if lamina.receiver.partition == "head":  # each server holds its KV head of every block
        for shard, server in enumerate(lamina.servers):
            assert torch.equal(server.kernel.caches[0][4], lamina.layers[0][1][shard:shard + 1])


@pytest.mark.parametrize("lamina", ["head"], indirect=True)
def test_a_byte_flipped_on_the_link_to_one_server_fails_the_push_with_the_layer_named(lamina):
    addresses = lamina.receiver._kv_addresses()
    proxy = ThrottledProxy(addresses[1], rate_bytes_per_s=None, corrupt_at=3000)
    lamina.receiver._kv_addrs = [addresses[0], proxy.address]  # server 1's KV arrives through the proxy
    try:
        done, failed = lamina.push("fe11", (1, 2, 3), (4, 5, 6))
        assert proxy.num_corrupted == 1 and failed == {"d1"}
        assert "KV checksum mismatch in layer" in lamina.receiver.take_errors()["d1"][0]
        assert lamina.stats.data["num_checksum_mismatches"] == 1
    finally:
        proxy.close()
