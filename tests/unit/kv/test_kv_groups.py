# SPDX-License-Identifier: Apache-2.0
"""KV cache groups (vLLM's hybrid allocator, `DisaggConnector` is `SupportsHMA`): each layer's blocks
travel by its own group's block tables, over real tcp sockets in one process. A Gemma-style model has
a full-attention group and a sliding-window group whose out-of-window blocks D never allocated."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_kv_push import INFO, NUM_LAYERS, Pair, _until
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_disagg.kv.handshake import decode_msg, encode_msg
from vllm_disagg.kv.metadata import RecvSpec, SaveSpec
from vllm_disagg.kv.register_body import encode_more_groups, parse_registered_blocks
from vllm_disagg.kv.scheduler import DisaggConnectorScheduler

HYBRID = dataclasses.replace(INFO, kv_groups="1,0,1")  # layers 0 and 2 windowed (group 1), layer 1 full
P_FULL, P_WINDOW = tuple(range(1, 8)), tuple(range(11, 18))  # P's 7 prompt blocks in each group
D_FULL, D_WINDOW, WINDOW_START = tuple(range(20, 27)), (28, 29, 30), 4  # D's window holds blocks 4..6


def _register(pair, verify_tid="t1"):
    pair.receiver.start([RecvSpec("d-" + verify_tid, verify_tid, pair.sender.address, D_FULL, 0, 100, 5.0,
                                  more_groups=((WINDOW_START, D_WINDOW),))])


@pytest.mark.parametrize("verify", [False, True])
def test_each_layer_lands_in_its_own_groups_blocks_and_nothing_outside_the_window_moves(verify):
    pair = Pair(p_info=HYBRID, d_info=HYBRID, verify=verify)
    try:
        _register(pair)
        pair.prefill_step([SaveSpec("p1", P_FULL, 100, 100, "t1", True, more_new_block_ids=(P_WINDOW,))])
        pair.sender.step_done()
        assert _until(pair.poll) == {"d-t1"} and not pair.failed
        full, window = 1, (0, 2)
        assert all(torch.equal(pair.d_layers[full][d], pair.p_layers[full][s]) for s, d in zip(P_FULL, D_FULL))
        for layer in window:
            assert all(torch.equal(pair.d_layers[layer][d], pair.p_layers[layer][s])
                       for s, d in zip(P_WINDOW[WINDOW_START:], D_WINDOW))
            assert not pair.d_layers[layer][list(D_FULL)].any()  # the full group's blocks: not this layer's
        assert not pair.d_layers[full][list(D_WINDOW)].any()
        assert pair.receiver.num_landed == 1
        pair.prefill_step([], release=["p1"])
        assert _until(pair.sender.finished_sending) == {"p1"}  # completed, so its bytes are counted
        assert sum(pair.p_stats.data["bytes_pushed"]) == (7 + 2 * 3) * INFO.block_nbytes
    finally:
        pair.close()


def test_decode_without_the_hybrid_allocator_is_refused_naming_the_flag():
    pair = Pair(p_info=HYBRID, d_info=INFO)
    try:
        pair.prefill_step([SaveSpec("p1", P_FULL, 100, 100, "t1", True, more_new_block_ids=(P_WINDOW,))])
        pair.receiver.start([RecvSpec("d-t1", "t1", pair.sender.address, D_FULL, 0, 100, 5.0)])
        _until(lambda: pair.poll() or pair.receiver._errors)
        why, fatal = pair.receiver.take_errors()["d-t1"]
        assert fatal and "'kv_groups'" in why and "--disable-hybrid-kv-cache-manager" in why
        assert not any(layer.any() for layer in pair.d_layers)
    finally:
        pair.close()


def test_a_register_frame_carries_every_group_and_is_checked_against_this_sides_groups():
    body = {"start_block": 0, "more_groups": encode_more_groups(((WINDOW_START, D_WINDOW),))}
    ids = D_FULL + D_WINDOW
    msg = decode_msg(encode_msg(_side_msg(body, ids)))
    assert parse_registered_blocks(msg.body, msg.block_ids, 2) == (D_FULL, 0, ((WINDOW_START, D_WINDOW),))
    with pytest.raises(ValueError, match="1 KV cache group"):
        parse_registered_blocks({"start_block": 0}, ids, 2)
    with pytest.raises(ValueError, match="2 KV cache group"):
        parse_registered_blocks(body, ids, 1)
    with pytest.raises(ValueError, match="does not fit"):
        parse_registered_blocks({**body, "more_groups": "4:99"}, ids, 2)
    with pytest.raises(ValueError):
        parse_registered_blocks({**body, "more_groups": "4:-1"}, ids, 2)


def _side_msg(body, ids):
    from vllm_disagg.kv.handshake import MsgType, SideMsg

    return SideMsg(MsgType.REGISTER, {"transfer_id": "t", **body}, ids)


def test_decode_registers_each_groups_blocks_from_its_first_block_inside_the_window():
    """vLLM's hybrid allocator gives a windowed group the null block before the window (and the full
    group every block); D registers each group from its own first real block."""
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    req = SimpleNamespace(request_id="r1", num_prompt_tokens=100, kv_transfer_params=dict(
        do_remote_prefill=True, transfer_id="t1", remote_host="127.0.0.1", remote_port=9100))
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    null = KVCacheBlock(0, is_null=True)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in (7, 8, 9, 10)], [null, null, KVCacheBlock(5), KVCacheBlock(6)]))
    s.update_state_after_alloc(req, blocks, 100)
    (spec,) = s.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                                     new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={}, preempted_req_ids=None)).recv_specs
    assert spec.groups() == ((0, (7, 8, 9, 10)), (2, (5, 6)))


def test_prefill_save_specs_carry_every_groups_new_blocks():
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    req = SimpleNamespace(request_id="p1", num_prompt_tokens=100, kv_transfer_params={"do_remote_decode": True,
                                                                                        "transfer_id": "t1"})
    s.update_state_after_alloc(req, KVCacheBlocks(([], [])), 0)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="p1", block_ids=([1, 2], [3, 4]), num_computed_tokens=0)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={"p1": 64}, preempted_req_ids=None)
    (spec,) = s.build_connector_meta(out).save_specs
    assert spec.groups() == ((1, 2), (3, 4)) and spec.num_computed_tokens == 64
    assert NUM_LAYERS == len(HYBRID.kv_groups.split(","))


def test_a_block_this_sides_window_left_out_is_never_pushed():
    """P holds vLLM's null block where its window dropped a block; a registration that wants it (the two
    sides' windows differ) fails the push instead of shipping bytes that belong to no request."""
    pair = Pair(p_info=HYBRID, d_info=HYBRID)
    try:
        pair.receiver.start([RecvSpec("d-t1", "t1", pair.sender.address, D_FULL, 0, 100, 5.0,
                                      more_groups=((3, (27, 28, 29, 30)),))])
        p_window = (0, 0, 0, 0, 15, 16, 17)
        pair.prefill_step([SaveSpec("p1", P_FULL, 100, 100, "t1", True, more_new_block_ids=(p_window,))])
        pair.sender.step_done()
        assert _until(pair.poll) == {"d-t1"} and pair.failed == {"d-t1"}
        assert "window left out" in pair.receiver.take_errors()["d-t1"][0]
        assert not pair.d_layers[0][[27, 28, 29, 30]].any()
        pair.prefill_step([], release=["p1"])
        assert _until(pair.sender.finished_sending) == {"p1"}
    finally:
        pair.close()
