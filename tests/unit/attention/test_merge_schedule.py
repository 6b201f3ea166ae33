# SPDX-License-Identifier: Apache-2.0
"""Exact softmax merge and the rotational pipelining schedule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_schedule import (
    Op,
    check_bubble_free,
    check_conflict_free,
    replica_for,
    rotational_schedule,
)

from vllm_disagg.attention.merge import merge_attn_states, partial_attention


def _full(q, k, v, scale):
    """Reference: plain softmax attention, GQA by repeating KV heads."""
    g = q.shape[1] // k.shape[2]
    kk = k.repeat_interleave(g, dim=2)
    vv = v.repeat_interleave(g, dim=2)
    logits = torch.einsum("bhd,blhd->bhl", q.double(), kk.double()) * scale
    return torch.einsum("bhl,blhd->bhd", torch.softmax(logits, -1), vv.double())


@given(
    length=st.integers(2, 70),
    split=st.floats(0.0, 1.0),
    shards=st.sampled_from([1, 2, 4]),
    big=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_merging_prev_and_new_equals_full_attention_across_head_shards(length, split, shards, big):
    torch.manual_seed(length)
    bsz, hq, hkv, d = 3, 8, 4, 16
    q = torch.randn(bsz, hq, d) * (30 if big else 1)  # big: logits far beyond exp's range
    k = torch.randn(bsz, length, hkv, d)
    v = torch.randn(bsz, length, hkv, d)
    scale = d**-0.5
    cut = int(split * length)
    outs = []
    for s in range(shards):  # head-wise shards: KV heads and their query-head groups
        kh = slice(s * hkv // shards, (s + 1) * hkv // shards)
        qh = slice(s * hq // shards, (s + 1) * hq // shards)
        a1, l1 = partial_attention(q[:, qh], k[:, :cut, kh], v[:, :cut, kh], scale)
        a2, l2 = partial_attention(q[:, qh], k[:, cut:, kh], v[:, cut:, kh], scale)
        outs.append(merge_attn_states(a1, l1, a2, l2)[0])
    merged = torch.cat(outs, dim=1)
    torch.testing.assert_close(merged.double(), _full(q, k, v, scale), atol=2e-5, rtol=1e-4)


def test_merge_with_an_empty_side_returns_the_other_side_and_both_empty_gives_zero():
    a = torch.randn(2, 4, 8)
    lse = torch.randn(2, 4)
    empty_out = torch.zeros(2, 4, 8)
    empty_lse = torch.full((2, 4), float("-inf"))
    out, merged_lse = merge_attn_states(empty_out, empty_lse, a, lse)
    torch.testing.assert_close(out, a)
    torch.testing.assert_close(merged_lse, lse)
    out, merged_lse = merge_attn_states(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.count_nonzero(out) == 0 and torch.isinf(merged_lse).all()


def test_partial_attention_masks_absent_keys():
    q = torch.randn(2, 4, 8)
    k = torch.randn(2, 5, 2, 8)
    v = torch.randn(2, 5, 2, 8)
    mask = torch.tensor([[True] * 3 + [False] * 2, [True] * 5])
    out, lse = partial_attention(q, k, v, 0.3, mask)
    ref0, lse0 = partial_attention(q[:1], k[:1, :3], v[:1, :3], 0.3)
    torch.testing.assert_close(out[:1], ref0)
    torch.testing.assert_close(lse[:1], lse0)


def test_the_replica_rule_is_the_papers_formula():
    assert [replica_for(j, 0, 4) for j in range(4)] == [1, 2, 3, 1]
    assert [replica_for(0, k, 2) for k in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError):
        replica_for(0, 0, 1)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("layers", [1, 3, 8])
def test_rotational_schedule_is_conflict_free_and_bubble_free(n, layers):
    ops = rotational_schedule(n, layers)
    assert sum(o.kind == "attn" for o in ops) == n * layers
    check_conflict_free(ops)
    if layers >= 2:
        check_bubble_free(ops, n)


def test_the_checks_catch_a_conflict_and_a_bubble():
    ops = rotational_schedule(3, 4)
    clash = ops + [Op("model", 9, 0, 1, 5, 7)]
    with pytest.raises(AssertionError, match="overlaps"):
        check_conflict_free(clash)
    holey = [o for o in ops if not (o.kind == "attn" and o.batch == 1 and o.index == 1)]
    with pytest.raises(AssertionError, match="idle"):
        check_bubble_free(holey, 3)


def test_request_wise_placement_follows_a_cached_prefix_to_its_server():
    """Prefix caching: a request that starts on cached blocks shares its first block with the request
    that wrote them and goes to that server, also after the writer's entry aged out."""
    from vllm_disagg.attention.partition import RequestPlacer
    from vllm_disagg.attention.wire import StepMeta

    def step(rows: list[tuple[list[int], int, int]]) -> StepMeta:  # (blocks, query_len, seq_len)
        qsl = torch.tensor([0] + [q for _, q, _ in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
        table = torch.tensor([b for b, _, _ in rows], dtype=torch.int32)
        slots = torch.zeros(int(qsl[-1]), dtype=torch.int64)
        return StepMeta(qsl, torch.tensor([s for _, _, s in rows], dtype=torch.int32), table, slots)

    placer = RequestPlacer(2, recent_steps=1)
    a, b = placer.split(step([([1, 2], 40, 40), ([3, 4], 40, 40)]))  # two fresh prompts: one per server
    assert (len(a.token_ids), len(b.token_ids)) == (40, 40)
    where = {first: placer.server_of(first) for first in (1, 3)}
    assert sorted(where.values()) == [0, 1]
    splits = placer.split(step([([1, 5], 8, 40), ([3, 4], 1, 41)]))  # a new request hits block 1's chain
    assert len(splits[where[1]].token_ids) == 8 and placer.num_prefix_affinity == 1  # the writer still ran
    placer._where.clear()  # the writers finished long ago; their chains stay cached in vLLM
    splits = placer.split(step([([3, 9], 8, 40)]))  # 32 tokens hit blocks 3.., 8 computed
    assert len(splits[where[3]].token_ids) == 8 and len(splits[1 - where[3]].token_ids) == 0
    assert placer.num_prefix_affinity == 2
    with pytest.raises(ValueError, match="never placed"):
        placer.split(step([([7, 8], 8, 40)]))
