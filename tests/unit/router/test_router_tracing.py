# SPDX-License-Identifier: Apache-2.0
"""A traced request through the router against real HTTP instance servers: the root span continues
the client's `traceparent`, and P and D receive a `traceparent` of the same trace plus X-Request-Id."""

from __future__ import annotations

from multidict import CIMultiDict
from test_router_proxy import deployment, run

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_root_span_continues_the_clients_trace_and_p_and_d_join_it(spans):
    async def scenario():
        async with deployment() as (url, session, ps, ds, _m, _r):
            headers = {"traceparent": TP, "X-Request-Id": "client-42"}
            async with session.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                                    headers=headers) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == "client-42"
                await resp.read()
            return ps[0].headers[-1], ds[0].headers[-1]

    p_headers, d_headers = run(scenario())
    by_name = {s.name: s for s in spans()}
    root = by_name["router.request"]
    assert root.parent.span_id == int("b7ad6b7169203331", 16)
    assert root.attributes["disagg.request_id"] == "client-42" and root.attributes["http.status_code"] == 200
    admission, prefill, decode = by_name["router.admission"], by_name["router.prefill"], by_name["router.decode"]
    assert all(s.parent.span_id == root.context.span_id for s in (admission, prefill, decode))
    assert admission.attributes["disagg.outcome"] == "admitted" and admission.attributes["disagg.route"] == "pd"
    assert admission.end_time <= decode.start_time  # admission, then the two halves at once
    for sent, span in ((CIMultiDict(p_headers), prefill), (CIMultiDict(d_headers), decode)):
        _, trace_id, parent_id, flags = sent["traceparent"].split("-")
        assert trace_id == "0af7651916cd43dd8448eb211c80319c" and flags == "01"
        assert int(parent_id, 16) == span.context.span_id  # P's and D's spans nest under the router's call
        assert sent["X-Request-Id"] == "client-42"


def test_a_replay_and_a_fallback_are_events_with_their_reason(spans):
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",)) as (url, session, _p, _d, ms, _r):
            ms[0].die_after, ms[0].die_times, ms[0].num_tokens = 1, 1, 3
            body = {"prompt": [5, 6], "max_tokens": 3, "stream": True, "return_token_ids": True}
            async with session.post(f"{url}/v1/completions", json=body, headers={"traceparent": TP}) as resp:
                assert resp.status == 200
                await resp.read()

    run(scenario())
    root = next(s for s in spans() if s.name == "router.request")
    events = {e.name: e.attributes for e in root.events}
    assert events["replay"]["disagg.reason"] == "mid_stream" and events["replay"]["disagg.attempt"] == 2
    assert len([s for s in spans() if s.name == "router.decode"]) == 2  # one per attempt


def test_health_and_metrics_are_not_traced(spans):
    async def scenario():
        async with deployment() as (url, session, _p, _d, _m, _r):
            for path in ("/health", "/metrics"):
                async with session.get(f"{url}{path}") as resp:
                    await resp.read()

    run(scenario())
    assert [s for s in spans() if s.name == "router.request"] == []
