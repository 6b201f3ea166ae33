# SPDX-License-Identifier: Apache-2.0
"""The router offers plain vLLM's whole API, each route by its class (router/api.py).

The route table is checked against the app vLLM itself builds (every task, dev mode, runtime LoRA);
the classes' behaviour against real HTTP instance servers (`instance_server.py`). Through real vLLM
instances: tests/integration/test_router_e2e.py lists a plain `vllm serve`'s OpenAPI routes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from multidict import CIMultiDict
from test_router_proxy import deployment, run

from vllm_disagg.router import api

_VLLM_ROUTES = r"""
import json
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["m", "--enable-lora"])
tasks = ("generate", "transcription", "embed", "classify", "token_embed", "token_classify")
app = build_app(args, supported_tasks=tasks)
print(json.dumps(sorted({(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ())})))
"""


def test_every_route_vllm_builds_has_a_class():
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
           "VLLM_TORCH_PROFILER_DIR": "/tmp/vd-profile"}
    out = subprocess.run([sys.executable, "-c", _VLLM_ROUTES], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    routes = [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]
    assert len(routes) > 50
    missing = [(m, p) for m, p in routes if m != "HEAD" and api.classify(m, p)[0] is None]
    assert missing == []


def test_stateless_admin_and_unknown_routes(monkeypatch):
    async def scenario():
        async with deployment() as (url, session, ps, ds, _, _r):
            async with session.post(f"{url}/tokenize", json={"prompt": "hi"}) as resp:
                assert resp.status == 200 and (await resp.json())["served_by"] == "d0"  # decode pool first
            async with session.get(f"{url}/version?x=1") as resp:
                assert (await resp.json())["path"] == "/version?x=1"
            async with session.post(f"{url}/reset_prefix_cache") as resp:
                assert resp.status == 200 and resp.headers["x-disagg-instances"] == "2"
            assert [c[1] for c in ps[0].calls + ds[0].calls].count("/reset_prefix_cache") == 2
            async with session.post(f"{url}/no/such/route") as resp:
                assert (resp.status, await resp.json()) == (404, {"detail": "Not Found"})
            async with session.get(f"{url}/tokenize") as resp:
                assert (resp.status, await resp.json()) == (405, {"detail": "Method Not Allowed"})
            async with session.post(f"{url}/v1/messages", json={"messages": [], "max_tokens": 3}) as resp:
                assert resp.status == 200 and (await resp.json())["served_by"] == "d0"
    run(scenario())


def test_stored_responses_are_sticky_and_unknown_ids_get_vllms_own_answer():
    async def scenario():
        async with deployment(p_modes=(), d_modes=("ok", "ok")) as (url, session, _, ds, _m, _r):
            async with session.post(f"{url}/v1/responses", json={"input": "hi", "store": True}) as resp:
                first = await resp.json()
            owner = next(d for d in ds if d.name == first["served_by"])
            for _ in range(3):  # follow-ups land where the first response lives
                async with session.post(f"{url}/v1/responses", json={"input": "more",
                                                                     "previous_response_id": first["id"]}) as resp:
                    assert (await resp.json())["served_by"] == owner.name
            async with session.get(f"{url}/v1/responses/{first['id']}") as resp:
                assert resp.status == 404  # the fake stores nothing: its own answer comes back
            assert owner.calls[-1][1] == f"/v1/responses/{first['id']}"
    run(scenario())


def test_api_key_request_id_and_authorization_reach_every_instance():
    async def scenario():
        async with deployment(api_keys=["sekret"]) as (url, session, ps, ds, _m, _r):
            async with session.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2}) as resp:
                assert (resp.status, await resp.json()) == (401, {"error": "Unauthorized"})
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 200  # unguarded, as on vllm serve
            auth = {"Authorization": "Bearer sekret", "X-Request-Id": "my-req-7"}
            async with session.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 2},
                                    headers=auth) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == "my-req-7"
            async with session.post(f"{url}/tokenize", json={"prompt": "x"}, headers=auth) as resp:
                assert resp.status == 200
            for sent in (ds[0].calls[-1][2], ds[0].headers[-1], ps[0].headers[-1]):  # relayed, D's and P's half
                sent = CIMultiDict(sent)
                assert sent["Authorization"] == "Bearer sekret" and sent["X-Request-Id"] == "my-req-7"
    run(scenario())


def test_health_degrades_while_either_pool_is_lost_and_fails_only_with_no_healthy_instance():
    """A lost prefill pool leaves D serving whole requests, a lost decode pool P: the router still
    serves, so a load balancer in front of it must not take it out. (503 while coming up:
    test_admission.py, test_health_is_503_while_a_pool_never_came_up.)"""
    async def scenario():
        async with deployment(health_interval_s=0.05) as (url, session, ps, ds, _m, router):
            async with session.get(f"{url}/ping") as resp:
                assert resp.status == 200
            ps[0].healthy = False
            await asyncio.sleep(0.3)
            async with session.get(f"{url}/health") as resp:
                body = await resp.json()
                assert resp.status == 200 and body["status"] == "degraded: no healthy prefill instance", body
            ps[0].healthy, ds[0].healthy = True, False
            await asyncio.sleep(0.3)
            async with session.get(f"{url}/health") as resp:
                body = await resp.json()
                assert resp.status == 200 and body["status"] == "degraded: no healthy decode instance", body
            async with session.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi"}) as resp:
                assert resp.status == 200 and resp.headers["x-disagg-route"] != "pd"
            assert len(ps[0].bodies) == 1 and ds[0].bodies == []
            ps[0].healthy = False
            await asyncio.sleep(0.3)
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 503
    run(scenario())
