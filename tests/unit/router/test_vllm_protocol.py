# SPDX-License-Identifier: Apache-2.0
"""`--pd-protocol vllm`: the router in front of vLLM's own P/D connectors (NixlConnector's request flow).

P runs first with vLLM's `do_remote_decode` params and answers with the kv_transfer_params D needs; D
then gets the client's request with them. A failed P leaves D the plain request (it computes the prompt).
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from test_router_proxy import _post, deployment, run

from vllm_disagg.router.bodies import VLLM_PREFILL_PARAMS
from vllm_disagg.router.config import RouterConfig


def test_prefill_runs_first_and_decode_gets_the_params_prefill_answered_with():
    async def scenario():
        async with deployment(pd_protocol="vllm") as (url, session, ps, ds, _, router):
            body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 5, "min_tokens": 2, "stream": False}
            status, headers, raw = await _post(session, url, body)
            assert status == 200 and headers["x-disagg-route"] == "pd" and json.loads(raw)["served_by"] == "d0"
            p_body, d_body = ps[0].bodies[0], ds[0].bodies[0]
            assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "min_tokens" not in p_body
            assert p_body["kv_transfer_params"] == VLLM_PREFILL_PARAMS
            assert d_body["kv_transfer_params"]["remote_engine_id"] == "p0"  # what P answered
            assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == body
            assert ds[0].arrivals[0] >= ps[0].arrivals[0]  # D only after P answered
    run(scenario())


def test_a_failed_prefill_leaves_decode_the_plain_request_and_is_counted():
    async def scenario():
        async with deployment(p_modes=("error",), pd_protocol="vllm") as (url, session, _ps, ds, _, router):
            status, _, _ = await _post(session, url, {"model": "m", "prompt": [5, 6], "max_tokens": 3})
            assert status == 200
            assert "kv_transfer_params" not in ds[0].bodies[0]
            text = router.metrics.render().decode()
            assert "vllm:disagg_router_prefill_failures_total" in text
    run(scenario())


def test_the_vllm_protocol_takes_no_prefill_kv_address_and_push_needs_one():
    with pytest.raises(ValidationError, match="prefill-kv"):
        RouterConfig(prefill_urls=["http://a:1"], prefill_kv=["a:2"], decode_urls=["http://b:1"], pd_protocol="vllm")
    with pytest.raises(ValidationError, match="prefill-kv"):
        RouterConfig(prefill_urls=["http://a:1"], decode_urls=["http://b:1"])
    RouterConfig(prefill_urls=["http://a:1"], decode_urls=["http://b:1"], pd_protocol="vllm")
