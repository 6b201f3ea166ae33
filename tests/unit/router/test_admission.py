# SPDX-License-Identifier: Apache-2.0
"""Router admission during a restart, and cutting attempts on an instance that left routing.

Against real HTTP instance servers (`instance_server.py`): a new request that finds no healthy
instance waits (bounded by `admission_wait_s`) and is served once one passes a health check or
discovery adds one; a client that leaves while it waits costs the instances nothing; an in-flight
request on an instance that is hung (not dead) is cut and replayed as soon as health checks drop
it, not after `read_timeout_s`. Real vLLM: tests/integration/test_model_worker_restart.py.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from instance_server import next_token
from test_router_proxy import _post, deployment, run

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.discovery import Member, apply_members
from vllm_disagg.router.server import Router, RouterServer


def _waits(router, outcome: str) -> float:
    value = router.metrics.registry.get_sample_value("vllm:disagg_router_admission_wait_seconds_count",
                                                     {"outcome": outcome})
    return value or 0.0


def _expected(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


def _stream_ids(raw: bytes) -> list[int]:
    ids = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                ids += choice.get("token_ids") or []
    return ids


async def _until(cond, timeout_s: float = 10.0) -> None:
    async def poll():
        while not cond():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout_s)


def test_a_new_request_waits_for_the_restarting_instance_and_is_served_when_it_is_back():
    """Streamed (replayable) and echo (not replayable) requests both wait, then succeed."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1) as (
                url, session, _, _d, ms, router):
            ms[0].healthy, ms[0].num_tokens = False, 4  # "restarting"
            await _until(lambda: not router.pools.is_healthy(ms[0].url))
            stream = asyncio.create_task(_post(session, url, {"model": "m", "prompt": [7, 8], "max_tokens": 4,
                                                              "stream": True, "return_token_ids": True}))
            batch = asyncio.create_task(_post(session, url, {"model": "m", "prompt": "ab", "echo": True}))
            await asyncio.sleep(0.5)
            assert not stream.done() and not batch.done() and ms[0].bodies == []  # waiting, not 503
            ms[0].healthy = True
            (s_status, _, s_raw), (b_status, _, _) = await asyncio.gather(stream, batch)
            assert s_status == 200 and _stream_ids(s_raw) == _expected([7, 8], 4)
            assert b_status == 200 and len(ms[0].bodies) == 2
            assert _waits(router, "admitted") == 2 and _waits(router, "timed_out") == 0
    run(scenario())


def test_a_new_request_gets_503_once_the_admission_wait_is_over():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1,
                              admission_wait_s=0.6) as (url, session, _, _d, ms, router):
            ms[0].healthy = False
            await _until(lambda: not router.pools.is_healthy(ms[0].url))
            for body in ({"prompt": [1], "stream": True}, {"prompt": "ab", "echo": True}):
                status, _, raw = await _post(session, url, body)
                assert status == 503 and json.loads(raw)["error"]["type"] == "ServiceUnavailable"
            assert _waits(router, "timed_out") == 2 and ms[0].bodies == []
    run(scenario())


def test_a_client_that_leaves_while_waiting_is_dropped_and_nothing_reaches_the_instance():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1) as (
                url, session, _, _d, ms, router):
            ms[0].healthy = False
            await _until(lambda: not router.pools.is_healthy(ms[0].url))
            async with aiohttp.ClientSession() as leaving:
                task = asyncio.create_task(_post(leaving, url, {"model": "m", "prompt": [5], "stream": True}))
                await asyncio.sleep(0.3)
                task.cancel()  # the client closes its connection mid-wait
                await asyncio.gather(task, return_exceptions=True)
            await _until(lambda: _waits(router, "client_gone") == 1)
            ms[0].healthy = True
            await _until(lambda: router.pools.is_healthy(ms[0].url))
            await asyncio.sleep(0.3)
            assert ms[0].bodies == []  # the abandoned request was never sent
            status, _, _ = await _post(session, url, {"model": "m", "prompt": [5], "max_tokens": 2})
            assert status == 200 and len(ms[0].bodies) == 1
            assert 'outcome="client_gone"' in router.metrics.render().decode()
    run(scenario())


def test_an_instance_added_by_discovery_wakes_a_waiting_request_at_once():
    """Dynamic membership starting empty (Ray/k8s before the first instance is up): the join itself,
    not a timer, ends the wait."""
    from instance_server import InstanceServer

    async def scenario():
        inst = await InstanceServer("m0").start()
        router = Router(RouterConfig(dynamic_membership=True, health_interval_s=60))
        server = RouterServer(router, "127.0.0.1", 0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(_post(session, server.url, {"model": "m", "prompt": [2, 3], "max_tokens": 3}))
                await asyncio.sleep(0.3)
                assert not task.done()
                apply_members(router.pools, [Member("mixed", inst.url)], router.health)
                status, _, raw = await asyncio.wait_for(task, 5)
                assert status == 200 and json.loads(raw)["served_by"] == "m0"
                assert _waits(router, "admitted") == 1
        finally:
            await server.stop()
            await inst.stop()
    run(scenario())


def test_health_under_discovery_waits_for_both_pools_then_degrades_when_decode_goes():
    """Kubernetes/Ray add members once ready: P alone is not a deployment that came up (503, naming the
    decode pool); once P and D were both seen, losing D leaves P serving whole requests (200 degraded)."""
    from instance_server import InstanceServer

    async def scenario():
        p, d = await InstanceServer("p0").start(), await InstanceServer("d0").start()
        router = Router(RouterConfig(dynamic_membership=True, health_interval_s=0.1))
        server = RouterServer(router, "127.0.0.1", 0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                async def health():
                    async with session.get(f"{server.url}/health") as resp:
                        return resp.status, (await resp.json())["status"]

                apply_members(router.pools, [Member("prefill", p.url, "127.0.0.1:9100")], router.health)
                await _until(lambda: router.pools.is_healthy(p.url))
                assert await health() == (503, "waiting for a healthy decode instance")
                apply_members(router.pools, [Member("prefill", p.url, "127.0.0.1:9100"), Member("decode", d.url)],
                              router.health)
                await _until(lambda: router.pools.is_healthy(d.url))
                assert await health() == (200, "ok")
                apply_members(router.pools, [Member("prefill", p.url, "127.0.0.1:9100")], router.health)
                assert await health() == (200, "degraded: no healthy decode instance")
        finally:
            await server.stop()
            await p.stop()
            await d.stop()
    run(scenario())


def _replay_reasons(router) -> str:
    return "\n".join(line for line in router.metrics.render().decode().splitlines()
                     if line.startswith("vllm:disagg_router_replays_total{"))


def test_a_request_on_a_hung_instance_is_cut_and_replayed_when_health_checks_drop_it():
    """m0 hangs (no answer, or stalls mid-stream) but stays connected; read_timeout_s is 300 s. Once
    its health checks fail the request moves to m1 and completes, exactly continued."""
    async def scenario():
        for mode, stream in (("stall", False), ("stall_mid_stream", True)):
            async with deployment(p_modes=(), d_modes=(), mixed_modes=(mode, "ok"), health_interval_s=0.1,
                                  read_timeout_s=300) as (url, session, _, _d, ms, router):
                for m in ms:
                    m.num_tokens = 6
                body = {"model": "m", "prompt": [4, 4, 2], "max_tokens": 6, "stream": stream,
                        "return_token_ids": True}
                task = asyncio.create_task(_post(session, url, body))
                await _until(lambda: len(ms[0].bodies) == 1)  # noqa: B023
                ms[0].healthy = False  # hung: its /health fails too
                status, _, raw = await asyncio.wait_for(task, 10)  # far below read_timeout_s
                ids = _stream_ids(raw) if stream else json.loads(raw)["choices"][0]["token_ids"]
                assert status == 200 and ids == _expected([4, 4, 2], 6), (mode, raw[-300:])
                assert len(ms[1].bodies) == 1
                if stream:  # went on from the token already sent
                    assert ms[1].bodies[0]["prompt"] == [4, 4, 2] + ids[:1]
                assert 'reason="left_routing"' in _replay_reasons(router)
    run(scenario())


async def _stalled_after_fast_steps(session, url, inst) -> asyncio.Task:
    """`inst` steps every 50 ms (/live's expected_step_s); a request lands on it, and then its engine
    owes progress for 1 s (it started a step and never beat again). Returns the request's task."""
    inst.live_expected_step_s = 0.05
    body = {"model": "m", "prompt": [4, 2], "max_tokens": 3, "return_token_ids": True}
    task = asyncio.create_task(_post(session, url, body))
    await _until(lambda: len(inst.bodies) == 1)
    inst.live_stalled_s = 1.0
    return task


def test_adaptive_stall_limit_cuts_an_instance_whose_fast_steps_stopped_long_before_the_fixed_timeout():
    """m0 steps every 50 ms (/live's expected_step_s) and then owes progress for 1 s: with --stall-factor 5
    (limit max(0.5 s, 5 x 50 ms)) it is cut and the request completes on m1; with the fixed 30 s limit
    alone it is not cut within 3 s."""
    async def scenario(factor):
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("stall", "ok"), health_interval_s=0.1,
                              stall_timeout_s=30, stall_factor=factor, stall_min_s=0.5) as (
                url, session, _, _d, ms, router):
            task = await _stalled_after_fast_steps(session, url, ms[0])
            done, _ = await asyncio.wait({task}, timeout=3)
            ms[0].healthy = False  # ends the control run: the plain health checks cut m0
            status, _, raw = await task
            return (status, json.loads(raw)["choices"][0]["token_ids"]) if done else None, router

    got, router = run(scenario(5.0))
    assert got == (200, _expected([4, 2], 3)) and 'reason="left_routing"' in _replay_reasons(router)
    assert run(scenario(None))[0] is None


def test_losing_only_the_prefill_instance_does_not_cut_the_decode_answer():
    """P/D push path: P hangs and is dropped; D's answer (it recomputes) goes on uncut."""
    async def scenario():
        async with deployment(p_modes=("stall",), d_modes=("ok",), health_interval_s=0.1) as (
                url, session, ps, ds, _, router):
            ds[0].num_tokens = 40
            task = asyncio.create_task(_post(session, url, {"model": "m", "prompt": [1, 2], "max_tokens": 40,
                                                            "stream": True, "return_token_ids": True}))
            await _until(lambda: len(ps[0].bodies) == 1 and len(ds[0].bodies) == 1)
            ps[0].healthy = False
            status, _, raw = await asyncio.wait_for(task, 10)
            assert status == 200 and _stream_ids(raw) == _expected([1, 2], 40)
            assert len(ds[0].bodies) == 1 and _replay_reasons(router) == ""
    run(scenario())


async def _by_hand_start(admission_wait_s: float, down: str = "p", step_s: float | None = None):
    """P still starting (its /health 503) and D up, as when both are started by hand (`down="d"`: the
    other way round); the instance that is up reports `step_s` as its engine's step time on /live."""
    from instance_server import InstanceServer

    p, d = InstanceServer("p0"), InstanceServer("d0")
    (p if down == "p" else d).healthy = False
    (d if down == "p" else p).live_expected_step_s = step_s
    await p.start()
    await d.start()
    config = RouterConfig(prefill_urls=[p.url], prefill_kv=["127.0.0.1:9100"], decode_urls=[d.url],
                          health_interval_s=0.1, admission_wait_s=admission_wait_s)
    router = Router(config)
    server = RouterServer(router, "127.0.0.1", 0)
    await server.start()
    return p, d, router, server


def test_at_start_up_the_first_request_waits_for_the_prefill_pool_and_takes_the_pd_path():
    """Not whole on D because D came up first; once P was up, losing it degrades to D at once."""
    async def scenario():
        p, d, router, server = await _by_hand_start(admission_wait_s=30)
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                task = asyncio.create_task(_post(session, server.url, body))
                await asyncio.sleep(0.5)
                assert not task.done() and d.bodies == [] and router.pools.starting()
                p.healthy = True
                status, headers, _ = await task
                assert status == 200 and headers["x-disagg-route"] == "pd" and len(p.bodies) == 1
                p.healthy = False
                await _until(lambda: not router.pools.is_healthy(p.url))
                status, headers, _ = await asyncio.wait_for(_post(session, server.url, body), 2)
                assert status == 200 and headers["x-disagg-route"] != "pd" and len(p.bodies) == 1
        finally:
            await server.stop()
            await p.stop()
            await d.stop()
    run(scenario())


def test_a_router_started_while_decode_is_down_serves_at_once_on_a_prefill_instance_that_has_served():
    """Not a deployment coming up: P's engine has stepped (its /live knows its step time), as when a
    router restarts while D restarts. A new request goes whole to P at once; it used to wait for D's
    first health check (9.7 s in the Lamina chaos soak, seed 2)."""
    async def scenario():
        p, d, router, server = await _by_hand_start(admission_wait_s=30, down="d", step_s=0.05)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
                status, headers, _ = await asyncio.wait_for(_post(session, server.url, body), 2)
                assert status == 200 and headers["x-disagg-route"] != "pd" and len(p.bodies) == 1
                assert not router.pools.starting() and d.bodies == [] and _waits(router, "admitted") == 0
                async with session.get(f"{server.url}/health") as resp:  # serving, so not taken out
                    body = await resp.json()
                    assert resp.status == 200 and body["status"] == "degraded: no healthy decode instance", body
        finally:
            await server.stop()
            await p.stop()
            await d.stop()
    run(scenario())


def test_health_is_503_while_a_pool_never_came_up():
    """By hand, D up first and P still starting: the deployment is coming up, /health says so (and
    names the pool) until P passes its first health check."""
    async def scenario():
        p, d, router, server = await _by_hand_start(admission_wait_s=30)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                await asyncio.sleep(0.3)
                async with session.get(f"{server.url}/health") as resp:
                    assert resp.status == 503 and "prefill" in (await resp.json())["status"]
                p.healthy = True
                await _until(lambda: router.pools.is_healthy(p.url))
                async with session.get(f"{server.url}/health") as resp:
                    assert resp.status == 200 and (await resp.json())["status"] == "ok"
        finally:
            await server.stop()
            await p.stop()
            await d.stop()
    run(scenario())


def test_at_start_up_a_prefill_pool_that_never_comes_up_costs_one_admission_wait_not_a_503():
    async def scenario():
        p, d, router, server = await _by_hand_start(admission_wait_s=0.5)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                status, headers, _ = await _post(session, server.url, {"model": "m", "prompt": [1], "max_tokens": 2})
                assert status == 200 and headers["x-disagg-route"] != "pd" and len(d.bodies) == 1
                assert _waits(router, "admitted") == 1 and p.bodies == []
        finally:
            await server.stop()
            await p.stop()
            await d.stop()
    run(scenario())


_SERVE = r"""
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from instance_server import InstanceServer
async def main():
    inst = await InstanceServer("stopped", num_tokens=int(sys.argv[2])).start()
    print(inst.port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_a_stream_on_a_sigstopped_instance_moves_on_once_its_health_polls_time_out():
    """A real hung process (SIGSTOP: its sockets stay open, nothing answers), not a 503 from /health."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from instance_server import InstanceServer

    num = 200
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(Path(__file__).parent), str(num)],
                            stdout=subprocess.PIPE, text=True)

    async def scenario():
        port = int(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        spare = await InstanceServer("spare", num_tokens=num).start()
        config = RouterConfig(mixed_urls=[f"http://127.0.0.1:{port}", spare.url], health_interval_s=0.2,
                              health_timeout_s=0.5, read_timeout_s=300)
        router = Router(config)
        server = RouterServer(router, "127.0.0.1", 0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                body = {"model": "m", "prompt": [6, 6], "max_tokens": num, "stream": True, "return_token_ids": True}
                raw = b""
                async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        raw += line
                        if raw.count(b"data: {") == 5:
                            os.kill(proc.pid, signal.SIGSTOP)
                assert _stream_ids(raw) == _expected([6, 6], num)
                assert len(spare.bodies) == 1 and spare.bodies[0]["prompt"][:2] == [6, 6]
                assert 'reason="left_routing"' in _replay_reasons(router)
        finally:
            await server.stop()
            await spare.stop()

    try:
        run(scenario())
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
