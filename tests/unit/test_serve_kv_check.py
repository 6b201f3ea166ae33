# SPDX-License-Identifier: Apache-2.0
"""serve_bench's check that a P/D deployment moved its KV (benchmarks/serve_run.py kv_check), on
known metric deltas: a request the router's overflow sent whole to D is no recompute; a push that
fell back, or prompt tokens D computed with no such route, fail the check."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serve_run import _KEEP, kv_check  # noqa: E402

LOCAL = "vllm:prompt_tokens_by_source_total{source=local_compute}"
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"


def _run(kind: str = "ours"):
    return SimpleNamespace(deployment=SimpleNamespace(is_pd=True, kind=kind))


def _deltas(d_local: float, *, routed_whole: int = 0, whole_on_prefill: int = 0, fallbacks: float = 0.0,
            num: int = 20, external_short: int = 0) -> dict:
    """`num` requests of 800 prompt tokens; P computes the prompts it got, D the last token of each.
    `routed_whole` of D's requests came whole to D; P served `whole_on_prefill` more whole."""
    pushed = 800 * (num - routed_whole)
    return {
        "prefill": {LOCAL: pushed + 800 * whole_on_prefill, "vllm:disagg_kv_bytes_pushed_total": 1e6},
        "decode": {LOCAL: d_local, EXTERNAL: pushed - (num - routed_whole) - external_short,
                   "vllm:request_success_total": num, "vllm:disagg_kv_fallbacks_total": fallbacks},
        "router": {"vllm:disagg_router_requests_total{endpoint=/v1/completions,outcome=ok,route=pd}":
                   num - routed_whole,
                   "vllm:disagg_router_requests_total{endpoint=/v1/completions,outcome=ok,route=plain}":
                   routed_whole + whole_on_prefill,
                   "vllm:disagg_router_whole_requests_total{pool=decode}": routed_whole,
                   "vllm:disagg_router_whole_requests_total{pool=prefill}": whole_on_prefill,
                   # prometheus' creation timestamp of a label set first seen in this window: not a count
                   "vllm:disagg_router_whole_requests_created{pool=decode}": 1.8e9},
    }


def test_every_prompt_pushed_is_verified():
    kv = kv_check(_run(), _deltas(d_local=20))
    assert kv["verified"] and kv["recomputes"] == 0 and kv["routed_whole"] == 0


def test_a_request_the_router_sent_whole_to_decode_is_no_recompute():
    kv = kv_check(_run(), _deltas(d_local=20 - 1 + 800, routed_whole=1))
    assert kv["verified"] and kv["recomputes"] == 0 and kv["routed_whole"] == 1


def test_a_push_that_fell_back_fails_the_check():
    kv = kv_check(_run(), _deltas(d_local=20 + 799, fallbacks=1))
    assert not kv["verified"] and kv["recomputes"] == 1 and kv["transfer_failures"] == 1


def test_prompt_tokens_computed_on_decode_without_a_whole_route_are_recomputes():
    kv = kv_check(_run("vllm"), _deltas(d_local=20 + 2 * 799))
    assert not kv["verified"] and kv["recomputes"] == 2


def test_requests_the_mixed_pool_served_whole_on_prefill_are_no_recompute():
    kv = kv_check(_run(), _deltas(d_local=20, whole_on_prefill=3))
    assert kv["verified"] and kv["routed_whole_by_pool"] == {"decode": 0, "prefill": 3}


def test_whole_requests_on_prefill_do_not_excuse_a_recompute_on_decode():
    """Before the pool label, any whole route excused D's local prompt tokens; now only D's own do."""
    kv = kv_check(_run(), _deltas(d_local=20 + 799, whole_on_prefill=1))
    assert not kv["verified"] and kv["recomputes"] == 1


def test_pushed_tokens_that_never_reached_decode_fail_the_check_even_with_whole_routes_to_decode():
    kv = kv_check(_run(), _deltas(d_local=20 - 1 + 800, routed_whole=1, external_short=400))
    assert not kv["verified"] and kv["recomputes"] == 1


def test_whole_routes_to_decode_longer_than_the_mean_prompt_are_no_recompute():
    """stop 48's 4 req/s probe: 7 of 20 requests went whole to D, with longer prompts than the 13 P
    computed (7265 tokens on D against 10320 on P); every pushed token arrived. The estimate from D's
    local tokens over the mean prompt counted 14 requests' worth, 7 of them 'recomputes'."""
    d = _deltas(d_local=0, routed_whole=7)
    d["prefill"][LOCAL] = 10320
    d["decode"].update({LOCAL: 7265, EXTERNAL: 10320})
    kv = kv_check(_run(), d)
    assert kv["verified"] and kv["recomputes"] == 0 and kv["routed_whole_by_pool"]["decode"] == 7


def test_every_counter_the_check_reads_is_scraped():
    """The router's whole-request counter was read but not scraped: an overflow run (3 requests sent
    whole to D at 4 req/s) failed the check as 3 recomputes."""
    for name in ("vllm:prompt_tokens_by_source_total", "vllm:disagg_router_whole_requests_total",
                 "vllm:request_success_total", "vllm:disagg_kv_fallbacks_total", "vllm:disagg_kv_bytes_pushed_total",
                 "vllm:nixl_num_failed_transfers_total"):
        assert name.startswith(_KEEP), name
