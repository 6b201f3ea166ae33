# SPDX-License-Identifier: Apache-2.0
"""State machine of the scheduler half (fake requests and scheduler outputs: pure bookkeeping)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_disagg.kv.scheduler import DisaggConnectorScheduler

BS = 32


def _req(req_id, n, **params):
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=n, kv_transfer_params=params or None)


def _blocks(ids, num_null=0):
    """vLLM's own allocation result; `num_null` leading null blocks, as a sliding-window group gives."""
    null = [KVCacheBlock(0, is_null=True) for _ in range(num_null)]
    return KVCacheBlocks(([*null, *(KVCacheBlock(i) for i in ids)],))


def _out(new=(), cached=(), sched=None, preempted=None):
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[(list(b),) if b else None for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=sched or {}, preempted_req_ids=preempted,
    )


D_PARAMS = dict(do_remote_prefill=True, transfer_id="t1", remote_host="127.0.0.1", remote_port=9100)


def test_decode_request_loads_the_whole_prompt_async_then_registers_its_blocks():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS, push_timeout_s=2.5)
    # STEP (1a) schedule: async load of every prompt token not cached locally
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)  # side-effect free
    s.update_state_after_alloc(req, _blocks([7, 8, 9, 10, 11]), 100)
    assert s.has_pending_push_work()
    # STEP (1b) the worker gets one registration with the prompt's 4 blocks only
    meta = s.build_connector_meta(_out())
    (spec,) = meta.recv_specs
    assert (spec.transfer_id, spec.remote, spec.block_ids, spec.start_block) == ("t1", "127.0.0.1:9100", (7, 8, 9, 10), 0)
    assert spec.push_timeout_s == 2.5
    assert s.build_connector_meta(_out()).recv_specs == []
    # STEP (1c) a failed load is never retried: the request recomputes locally
    s.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"r1"}))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.request_finished(req, [7, 8, 9, 10]) == (False, None)
    assert not s.has_pending_push_work()


def test_decode_with_a_local_prefix_hit_registers_only_the_missing_blocks():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS)
    assert s.get_num_new_matched_tokens(req, 64) == (36, True)
    s.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 36)
    (spec,) = s.build_connector_meta(_out()).recv_specs
    assert (spec.block_ids, spec.start_block) == ((3, 4), 2)


def test_a_windowed_decode_request_registers_from_its_first_block_inside_the_window():
    """Mistral-style sliding-window group: vLLM hands D the null block for blocks wholly before the
    window; P pushes only the rest (found by a per-block checksum run: P's bytes landed in block 0)."""
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS)
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    s.update_state_after_alloc(req, _blocks([5, 6, 7], num_null=1), 100)
    (spec,) = s.build_connector_meta(_out()).recv_specs
    assert (spec.block_ids, spec.start_block) == ((5, 6, 7), 1)


def test_malformed_transfer_params_fall_back_to_local_prefill():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    for bad in ({"remote_port": "x"}, {"transfer_id": ""}, {"remote_host": None}, {"push_timeout_s": -1}):
        assert s.get_num_new_matched_tokens(_req("r", 100, **{**D_PARAMS, **bad}), 0) == (0, False)
    assert s.get_num_new_matched_tokens(_req("r", 100), 0) == (0, False)


def test_prefill_request_is_announced_once_then_tracked_per_chunk_until_released():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("p1", 100, do_remote_decode=True, transfer_id="t9")
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, _blocks([]), 0)
    # STEP (1a) first chunk: 64 tokens on blocks 3,4
    (spec,) = s.build_connector_meta(_out(new=[("p1", [3, 4], 0)], sched={"p1": 64})).save_specs
    assert (spec.transfer_id, spec.new_block_ids, spec.num_computed_tokens, spec.replace_blocks) == ("t9", (3, 4), 64, True)
    # STEP (2a) second chunk: the rest on blocks 5,6
    (spec,) = s.build_connector_meta(_out(cached=[("p1", [5, 6], 64)], sched={"p1": 36})).save_specs
    assert (spec.transfer_id, spec.new_block_ids, spec.num_computed_tokens, spec.replace_blocks) == (None, (5, 6), 100, False)
    # STEP (3) finished after one token: blocks stay until the worker's finished_sending
    delay, params = s.request_finished(req, [3, 4, 5, 6])
    assert delay and params == {"transfer_id": "t9", "pushed": True}
    assert s.build_connector_meta(_out()).release_req_ids == ["p1"]
    assert s.has_pending_push_work()
    s.update_connector_output(SimpleNamespace(finished_sending={"p1"}, finished_recving=set()))
    assert not s.has_pending_push_work()


def test_prefill_request_aborted_before_it_ran_frees_its_blocks_at_once():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("p1", 100, do_remote_decode=True, transfer_id="t9")
    s.update_state_after_alloc(req, _blocks([]), 0)
    assert s.request_finished(req, []) == (False, {"transfer_id": "t9", "pushed": False})
    assert not s.has_pending_push_work()


def test_preempted_prefill_requests_are_passed_to_the_worker():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("p1", 100, do_remote_decode=True, transfer_id="t9")
    s.update_state_after_alloc(req, _blocks([]), 0)
    s.build_connector_meta(_out(new=[("p1", [3], 0)], sched={"p1": 32}))
    assert s.build_connector_meta(_out(preempted={"p1", "other"})).preempted_req_ids == ["p1"]


def test_both_sides_carry_the_same_prompt_digest():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    d_req = _req("d", 40, **D_PARAMS)
    p_req = _req("p", 40, do_remote_decode=True, transfer_id="t1")
    d_req.prompt_token_ids = p_req.prompt_token_ids = list(range(40))
    s.get_num_new_matched_tokens(d_req, 0)
    s.update_state_after_alloc(d_req, _blocks([1, 2]), 40)
    s.update_state_after_alloc(p_req, _blocks([]), 0)
    meta = s.build_connector_meta(_out(new=[("p", [5, 6], 0)], sched={"p": 40}))
    assert meta.recv_specs[0].prompt_digest == meta.save_specs[0].prompt_digest != ""


def test_a_failed_push_reason_reaches_the_decode_response_and_marks_mismatches_fatal():
    from vllm_disagg.kv.metadata import DisaggWorkerMetadata

    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 100)
    meta = DisaggWorkerMetadata(errors={"r1": "handshake mismatch on 'dtype'"}, fatal={"r1"})
    meta = meta.aggregate(DisaggWorkerMetadata())
    s.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving=set(),
                                              kv_connector_worker_meta=meta))
    assert s.is_fatal_load_failure("r1") and not s.is_fatal_load_failure("r2")
    assert s.request_finished(req, []) == (False, {"disagg_kv_error": "handshake mismatch on 'dtype'"})
    assert not s.is_fatal_load_failure("r1")


def test_the_worker_refuses_to_start_without_a_shared_token(monkeypatch):
    import pytest

    from vllm_disagg.config import DisaggConfigError
    from vllm_disagg.kv.worker import DisaggConnectorWorker

    monkeypatch.delenv("VLLM_DISAGG_AUTH_TOKEN", raising=False)
    cfg = SimpleNamespace(additional_config={"disagg": {"role": "prefill", "kv": {"kv_port": 0}}},
                          kv_transfer_config=SimpleNamespace(kv_role="kv_producer", kv_load_failure_policy="recompute"))
    worker = DisaggConnectorWorker(cfg)
    with pytest.raises(DisaggConfigError, match="VLLM_DISAGG_AUTH_TOKEN"):
        worker.register_kv_caches({})


def test_a_decode_request_aborted_while_its_push_is_pending_cancels_it_on_the_prefill_side():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS, traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _blocks([7, 8, 9, 10]), 100)
    (spec,) = s.build_connector_meta(_out()).recv_specs
    assert spec.trace is not None and spec.trace.sampled and spec.trace.trace_id.hex().startswith("4bf92f35")
    assert s.request_finished(req, [7, 8, 9, 10]) == (False, None)  # vLLM delays the free itself
    assert s.has_pending_push_work()
    (cancel,) = s.build_connector_meta(_out()).cancel_specs
    assert (cancel.req_id, cancel.transfer_id, cancel.remote) == ("r1", "t1", "127.0.0.1:9100")
    assert "aborted" in cancel.reason and not s.has_pending_push_work()


def test_a_request_that_finished_after_its_push_landed_cancels_nothing():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _blocks([7, 8, 9, 10]), 100)
    s.build_connector_meta(_out())
    s.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"r1"}))
    s.request_finished(req, [7, 8, 9, 10])
    assert s.build_connector_meta(_out()).cancel_specs == []


def test_a_push_taken_over_from_the_attention_servers_is_cancelled_on_the_prefill_side():
    reuse = SimpleNamespace(takes_over_push=lambda request, n: 96, update_state_after_alloc=lambda *a: None,
                            build_meta=lambda out: None, request_finished=lambda *a: None)
    s = DisaggConnectorScheduler(BS, push_timeout_s=30, reuse=reuse)
    req = _req("r1", 100, **D_PARAMS)
    assert s.get_num_new_matched_tokens(req, 0) == (96, False)
    s.update_state_after_alloc(req, _blocks([7, 8, 9, 10]), 96)
    meta = s.build_connector_meta(_out())
    assert meta.recv_specs == [] and [c.transfer_id for c in meta.cancel_specs] == ["t1"]
    assert "attention servers" in meta.cancel_specs[0].reason
    s.update_state_after_alloc(req, _blocks([7, 8, 9, 10]), 96)  # again (after a preemption): once only
    assert s.build_connector_meta(_out()).cancel_specs == []


def test_an_aborted_prefill_request_has_its_push_abandoned():
    s = DisaggConnectorScheduler(BS, push_timeout_s=30)
    req = _req("p1", 64, do_remote_decode=True, transfer_id="t9")
    s.update_state_after_alloc(req, _blocks([1, 2]), 0)
    s.build_connector_meta(_out(new=[("p1", [1, 2], 0)], sched={"p1": 64}))
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert s.request_finished(req, [1, 2])[0] is True  # blocks stay until the worker says the push is over
    meta = s.build_connector_meta(_out())
    assert meta.release_req_ids == ["p1"] and meta.abandoned_req_ids == ["p1"]
