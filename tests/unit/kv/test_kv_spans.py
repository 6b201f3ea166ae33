# SPDX-License-Identifier: Apache-2.0
"""Spans of the connector for a traced request: P's queue and compute, D's queue, KV wait (with the
fallback event when the push fails), first step and decode, and P's push with one event per write.
Untraced requests record nothing."""

from __future__ import annotations

import time
from types import SimpleNamespace

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_disagg.kv.scheduler import DisaggConnectorScheduler
from vllm_disagg.observe import tracing

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ROUTER_SPAN = int("b7ad6b7169203331", 16)
D_PARAMS = dict(do_remote_prefill=True, transfer_id="t1", remote_host="127.0.0.1", remote_port=9100)


def _req(req_id, n, traced=True, **params):
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=n, kv_transfer_params=params or None,
                           trace_headers={"traceparent": TP} if traced else None, arrival_time=time.time() - 0.01,
                           num_output_tokens=0, status="FINISHED_STOPPED")


def _blocks(ids, num_null=0):
    """vLLM's own allocation result; `num_null` leading null blocks, as a sliding-window group gives."""
    null = [KVCacheBlock(0, is_null=True) for _ in range(num_null)]
    return KVCacheBlocks(([*null, *(KVCacheBlock(i) for i in ids)],))


def _out(new=()):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={r: 100 for r, _, _ in new}, preempted_req_ids=None)


def _by_name(spans):
    return {s.name: s for s in spans()}


def test_decode_request_spans_chain_queue_wait_first_step_decode(spans):
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 100)
    (spec,) = s.build_connector_meta(_out()).recv_specs
    s.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"r1"}))
    s.build_connector_meta(_out())  # no token yet: still in the first step
    req.num_output_tokens = 1
    s.build_connector_meta(_out())
    req.num_output_tokens = 8
    s.request_finished(req, [1, 2, 3, 4])
    got = _by_name(spans)
    assert list(got) == ["decode.queue", "kv.wait", "decode.first_step", "decode"]
    assert all(sp.parent.span_id == ROUTER_SPAN for sp in got.values())
    chain = [got[n] for n in ("decode.queue", "kv.wait", "decode.first_step", "decode")]
    assert all(a.end_time == b.start_time for a, b in zip(chain, chain[1:]))
    assert tracing.to_wire(got["kv.wait"].context) == spec.trace  # what D's worker and P's push hang under
    assert got["decode"].attributes["disagg.num_output_tokens"] == 8


def test_a_failed_push_is_a_fallback_event_on_the_kv_wait(spans):
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    req = _req("r1", 100, **D_PARAMS)
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 100)
    s.build_connector_meta(_out())
    from vllm_disagg.kv.metadata import DisaggWorkerMetadata

    s.update_connector_output(SimpleNamespace(finished_sending=set(), finished_recving={"r1"}, failed_recving={"r1"},
                                              kv_connector_worker_meta=DisaggWorkerMetadata({"r1": "P lost"})))
    s.request_finished(req, [])
    wait = _by_name(spans)["kv.wait"]
    (event,) = wait.events
    assert (event.name, event.attributes["disagg.reason"], event.attributes["disagg.detail"]) == \
        ("fallback", "recompute", "P lost")


def test_prefill_request_spans_and_the_push_context_in_its_save_spec(spans):
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    req = _req("p1", 100, do_remote_decode=True, transfer_id="t1")
    s.update_state_after_alloc(req, _blocks([5, 6, 7, 8]), 0)
    (save,) = s.build_connector_meta(_out(new=[("p1", [5, 6, 7, 8], 0)])).save_specs
    req.num_output_tokens = 1
    s.request_finished(req, [5, 6, 7, 8])
    got = _by_name(spans)
    assert list(got) == ["prefill.queue", "prefill.compute"]
    assert tracing.to_wire(got["prefill.compute"].context) == save.trace


def test_untraced_and_plain_requests(spans):
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    untraced = _req("u", 100, traced=False, **D_PARAMS)
    s.get_num_new_matched_tokens(untraced, 0)
    s.update_state_after_alloc(untraced, _blocks([1, 2, 3, 4]), 100)
    assert s.build_connector_meta(_out()).recv_specs[0].trace is None
    plain = _req("m", 10)
    s.update_state_after_alloc(plain, _blocks([9]), 0)
    plain.num_output_tokens = 1
    s.build_connector_meta(_out())
    s.request_finished(plain, [9])
    s.request_finished(untraced, [])
    assert list(_by_name(spans)) == ["queue", "prefill", "decode"]


def test_every_nth_step_of_a_traced_request_samples_its_attention_calls(spans, monkeypatch):
    monkeypatch.setenv("VLLM_DISAGG_TRACE_ATTENTION_EVERY", "4")
    s = DisaggConnectorScheduler(32, push_timeout_s=30)
    plain = _req("m", 10)
    s.update_state_after_alloc(plain, _blocks([9]), 0)
    picks = [s.spans.step_trace({"m": 1}) for _ in range(9)]
    assert [p is not None for p in picks] == [True, False, False, False, True, False, False, False, True]
    assert s.spans.step_trace({"other": 1}) is None  # not scheduled this step
    assert picks[0].sampled and picks[0].trace_id == bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
