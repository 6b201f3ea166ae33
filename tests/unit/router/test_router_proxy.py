# SPDX-License-Identifier: Apache-2.0
"""The router against real HTTP instance servers: push-protocol bodies, relaying, failures, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
from instance_server import InstanceServer, next_token

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.server import Router, RouterServer


@contextlib.asynccontextmanager
async def deployment(p_modes=("ok",), d_modes=("ok",), mixed_modes=(), prefill_kv=None, **cfg):
    ps = [await InstanceServer(f"p{i}", m).start() for i, m in enumerate(p_modes)]
    ds = [await InstanceServer(f"d{i}", m).start() for i, m in enumerate(d_modes)]
    ms = [await InstanceServer(f"m{i}", m).start() for i, m in enumerate(mixed_modes)]
    kv = [] if cfg.get("pd_protocol") == "vllm" else [f"127.0.0.1:{9100 + i}" for i in range(len(ps))]
    kv = kv if prefill_kv is None else prefill_kv
    config = RouterConfig(prefill_urls=[p.url for p in ps], prefill_kv=kv,
                          decode_urls=[d.url for d in ds], mixed_urls=[m.url for m in ms], **cfg)
    router = Router(config)
    server = RouterServer(router, "127.0.0.1", 0)
    await server.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            yield server.url, session, ps, ds, ms, router
    finally:
        await server.stop()
        for inst in [*ps, *ds, *ms]:
            await inst.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def _post(session, url, body, path="/v1/completions"):
    async with session.post(f"{url}{path}", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def _sse_events(raw: bytes) -> list:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_push_path_sends_prefill_and_decode_bodies_per_protocol_with_one_transfer_id():
    async def scenario():
        async with deployment() as (url, session, ps, ds, _, _r):
            body = {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 5, "min_tokens": 2,
                    "stream": False, "temperature": 0}
            status, headers, raw = await _post(session, url, body)
            assert status == 200 and headers["x-disagg-route"] == "pd"
            assert json.loads(raw)["served_by"] == "d0"
            p_body, d_body = ps[0].bodies[0], ds[0].bodies[0]
            assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "min_tokens" not in p_body
            assert p_body["kv_transfer_params"]["do_remote_decode"] is True
            d_params = d_body["kv_transfer_params"]
            assert d_params["do_remote_prefill"] is True
            assert (d_params["remote_host"], d_params["remote_port"]) == ("127.0.0.1", 9100)
            assert d_params["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
            assert {k: v for k, v in d_body.items() if k != "kv_transfer_params"} == body  # not streamed: as is
            # concurrent dispatch: D is not held back until P answers
            assert abs(ds[0].arrivals[0] - ps[0].arrivals[0]) < 0.5
    run(scenario())


def test_chat_prefill_body_caps_max_completion_tokens_too():
    async def scenario():
        async with deployment() as (url, session, ps, ds, _, _r):
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
            status, _, _ = await _post(session, url, body, "/v1/chat/completions")
            assert status == 200
            assert ps[0].bodies[0]["max_completion_tokens"] == 1
            assert ds[0].bodies[0]["max_completion_tokens"] == 9
    run(scenario())


def test_streaming_response_of_decode_is_relayed_unchanged():
    async def scenario():
        async with deployment() as (url, session, _, ds, _m, _r):
            ds[0].num_tokens = 4
            body = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}
            status, headers, raw = await _post(session, url, body)
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
            events = _sse_events(raw)
            assert events[-1] == "[DONE]"
            context = list(b"hello")
            for event in events[:-1]:
                assert event["choices"][0]["text"] == f" t{next_token(context)}"
                assert "token_ids" not in event["choices"][0]  # added upstream for replay, stripped here
                context.append(next_token(context))
            assert ds[0].bodies[0]["return_token_ids"] is True
    run(scenario())


def test_failed_prefill_still_returns_the_decode_answer_and_is_counted():
    async def scenario():
        async with deployment(p_modes=("error",)) as (url, session, _, _d, _m, router):
            status, _, raw = await _post(session, url, {"prompt": "x", "max_tokens": 2})
            assert status == 200 and json.loads(raw)["served_by"] == "d0"
            await asyncio.sleep(0.1)
            metrics = router.metrics.render().decode()
            assert "vllm:disagg_router_prefill_failures_total{" in metrics
    run(scenario())


def test_decode_dying_mid_stream_ends_the_stream_with_an_error_event():
    async def scenario():
        async with deployment(d_modes=("die_mid_stream",), replay_attempts=0) as (url, session, _, _d, _m, _r):
            status, _, raw = await _post(session, url, {"prompt": "x", "max_tokens": 3, "stream": True})
            assert status == 200
            events = _sse_events(raw)
            assert events[-1] == "[DONE]"
            assert "error" in events[-2] and events[-2]["error"]["code"] == 502
    run(scenario())


def test_silent_decode_fails_cleanly_after_the_read_timeout():
    async def scenario():
        async with deployment(d_modes=("stall",), read_timeout_s=1.0, replay_attempts=0) as (url, session, _, _d, _m, _r):
            t0 = time.monotonic()
            status, _, raw = await _post(session, url, {"prompt": "x", "max_tokens": 3})
            assert status == 502 and "error" in json.loads(raw)
            assert time.monotonic() - t0 < 10
    run(scenario())


def test_stalled_stream_is_ended_with_an_error_event_after_the_read_timeout():
    async def scenario():
        async with deployment(d_modes=("stall_mid_stream",), read_timeout_s=1.0, replay_attempts=0) as (url, session, *_):
            status, _, raw = await _post(session, url, {"prompt": "x", "max_tokens": 3, "stream": True})
            events = _sse_events(raw)
            assert status == 200 and "error" in events[-2] and events[-1] == "[DONE]"
    run(scenario())


def test_refused_decode_connection_is_rerouted_to_another_decode_instance():
    async def scenario():
        async with deployment(d_modes=("ok", "ok"), health_interval_s=60) as (url, session, _, ds, _m, router):
            await ds[0].stop()  # d0 is gone; the health poll has not noticed yet
            for _ in range(3):
                status, headers, raw = await _post(session, url, {"prompt": "x", "max_tokens": 2})
                assert status == 200 and json.loads(raw)["served_by"] == "d1"
            assert not router.pools.is_healthy(ds[0].url)
    run(scenario())


def test_health_checks_drop_a_dead_instance_and_restore_it():
    async def scenario():
        async with deployment(d_modes=("ok", "ok"), health_interval_s=0.1,
                              health_failures_to_drop=2) as (url, session, _, ds, _m, router):
            ds[0].healthy = False
            await asyncio.sleep(0.6)
            assert not router.pools.is_healthy(ds[0].url)
            for _ in range(3):
                _, headers, _ = await _post(session, url, {"prompt": "x", "max_tokens": 1})
                assert headers["x-disagg-decode"] == ds[1].url
            ds[0].healthy = True
            await asyncio.sleep(0.4)
            assert router.pools.is_healthy(ds[0].url)
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert f'vllm:disagg_router_instance_healthy{{instance="{ds[0].url}",pool="decode"}} 1.0' in text
    run(scenario())


def test_without_prefill_instances_requests_go_whole_to_decode_and_count_as_fallback():
    async def scenario():
        async with deployment(health_interval_s=0.1, health_failures_to_drop=1) as (url, session, ps, ds, _, r):
            ps[0].healthy = False
            await asyncio.sleep(0.4)
            status, headers, _ = await _post(session, url, {"prompt": "x", "max_tokens": 1})
            assert status == 200 and headers["x-disagg-route"] == "plain"
            assert "kv_transfer_params" not in ds[0].bodies[-1]
            text = r.metrics.render().decode()
            assert 'vllm:disagg_router_fallbacks_total{reason="mixed_pool"}' in text
            assert 'vllm:disagg_router_whole_requests_total{pool="decode"} 1.0' in text  # serve_bench's KV check
    run(scenario())


def test_with_no_admission_wait_no_healthy_instance_gives_503_at_once_and_health_reports_it():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1,
                              health_failures_to_drop=1, admission_wait_s=0) as (url, session, _, _d, ms, _r):
            ms[0].healthy = False
            await asyncio.sleep(0.4)
            status, _, raw = await _post(session, url, {"prompt": "x"})
            assert status == 503 and json.loads(raw)["error"]["code"] == 503
            async with session.get(f"{url}/health") as resp:
                assert resp.status == 503
    run(scenario())


def test_bad_json_body_is_rejected_with_400():
    async def scenario():
        async with deployment() as (url, session, *_):
            async with session.post(f"{url}/v1/completions", data=b"{nope") as resp:
                assert resp.status == 400
            async with session.post(f"{url}/v1/completions", json=[1, 2]) as resp:
                assert resp.status == 400
    run(scenario())


def test_models_and_metrics_endpoints_answer():
    async def scenario():
        async with deployment() as (url, session, *_):
            async with session.get(f"{url}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "fake"
            await _post(session, url, {"prompt": "x", "max_tokens": 1})
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert 'vllm:disagg_router_requests_total{endpoint="completions",outcome="ok",route="pd"} 1.0' in text
            assert 'vllm:disagg_router_queue_tokens{pool="prefill"}' in text
    run(scenario())


def test_sixteen_concurrent_requests_spread_over_two_decode_instances_and_release_their_bookings():
    async def scenario():
        async with deployment(p_modes=("ok", "ok"), d_modes=("ok", "ok")) as (url, session, ps, ds, _, router):
            bodies = [{"prompt": [1] * 100, "max_tokens": 3} for _ in range(16)]
            results = await asyncio.gather(*(_post(session, url, b) for b in bodies))
            assert all(status == 200 for status, _, _ in results)
            assert len(ds[0].bodies) > 0 and len(ds[1].bodies) > 0
            assert len(ps[0].bodies) > 0 and len(ps[1].bodies) > 0
            await asyncio.sleep(0.1)
            assert router.pools.scheduler.num_active_requests == 0
            assert all(s.num_pending_tokens == 0 for s in router.pools.scheduler.instances.values())
    run(scenario())


def test_pooled_connections_are_dropped_before_the_instance_closes_them_so_none_fails_mid_reuse():
    """vLLM's uvicorn closes an idle connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); aiohttp's
    default pool keeps one 15 s. A request sent on a connection as uvicorn closes it fails with
    ServerDisconnectedError (a /scale_elastic_ep 502 in CI). Here uvicorn closes after 0.1 s, requests
    come every ~0.1 s, and every one must answer (aiohttp re-sends a GET on its own, so a POST): the
    router's pool lets go after 0.05 s (without that, 2 of 3 runs saw a 502)."""
    import uvicorn
    from fastapi import FastAPI

    from vllm_disagg.launch.instances import free_ports

    app = FastAPI()
    app.get("/health")(lambda: {})
    app.post("/tokenize")(lambda: {"tokens": [1]})
    (port,) = free_ports(1)
    config = RouterConfig(mixed_urls=[f"http://127.0.0.1:{port}"], idle_keepalive_s=0.05)
    assert RouterConfig.model_fields["idle_keepalive_s"].default < 5

    async def scenario():
        upstream = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, timeout_keep_alive=0.1,
                                                 log_level="error"))
        serving = asyncio.create_task(upstream.serve())
        while not upstream.started:
            await asyncio.sleep(0.02)
        router = RouterServer(Router(config), "127.0.0.1", 0)
        await router.start()
        statuses = []
        try:
            async with aiohttp.ClientSession() as session:
                for i in range(40):
                    async with session.post(f"{router.url}/tokenize", json={"prompt": "x"}) as resp:
                        statuses.append(resp.status)
                    await asyncio.sleep(0.09 + (i % 20) * 0.001)
        finally:
            await router.stop()
            upstream.should_exit = True
            await serving
        assert statuses == [200] * 40

    run(scenario())
