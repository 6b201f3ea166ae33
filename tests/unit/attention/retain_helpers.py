# SPDX-License-Identifier: Apache-2.0
"""Shared by test_retain.py and test_claim.py: the small geometry, block keys, a connected client,
one request's step metadata and an all-layer attend over real servers."""

from __future__ import annotations

import torch

from vllm_disagg.attention import wire
from vllm_disagg.attention.client import ClientMeta, DisaggAttentionClient

TOKEN = "retain-token"
BS = 32
GEOM = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_size=32, block_size=BS, dtype="float32",
            max_num_tokens=256)


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _client(*infos, partition: str = "head") -> DisaggAttentionClient:
    client = DisaggAttentionClient([i["http"] for i in infos], transport="tcp", partition=partition,
                                   send_q_early=False, auth_token=TOKEN)
    client.connect(**GEOM)
    return client


def _step(table: list[int], start: int, length: int) -> ClientMeta:
    """One request at positions [start, start+length) over block ids `table`."""
    pos = torch.arange(start, start + length)
    bt = torch.tensor([table], dtype=torch.int32)
    slots = bt[0, pos // BS].long() * BS + pos % BS
    step = wire.StepMeta(torch.tensor([0, length], dtype=torch.int32),
                         torch.tensor([start + length], dtype=torch.int32), bt, slots)
    return ClientMeta(step, max_query_len=length, num_actual_tokens=length)


def _attend(client, meta: ClientMeta, q, k, v) -> torch.Tensor:
    out = torch.empty(q.shape)
    for layer in range(GEOM["num_layers"]):
        client.attend(layer, q, k, v, meta, 0.2, out)
    return out
