# SPDX-License-Identifier: Apache-2.0
"""Hang detection and the bounded admission queue, against real HTTP instance servers.

An instance whose engine makes no progress (its `/live` reports a stall, vllm_disagg/liveness/)
is cut once its stall passes `stall_timeout_s`, and stays out while it is stuck; a request that
cannot be replayed is sent whole to another instance when nothing of it reached the client, and a
stream of it that had started ends with an error naming the stall. Past `max_waiting` requests
waiting for admission, a new one gets 503 with Retry-After at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from test_admission import _expected, _replay_reasons, _stalled_after_fast_steps, _stream_ids, _until
from test_router_proxy import _post, deployment, run

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.server import Router

NOT_REPLAYABLE = {"model": "m", "prompt": [1, 2, 3], "n": 2, "max_tokens": 3, "temperature": 0}  # never replayed


def test_a_stuck_instance_is_cut_after_the_stall_timeout_and_its_request_answered_by_another():
    async def scenario():
        async with deployment(p_modes=("ok",), d_modes=("stall",), health_interval_s=0.1, stall_timeout_s=0.5,
                              health_failures_to_drop=100) as (url, session, ps, ds, _, router):
            ds[0].live_stalled_s = 0.0
            await asyncio.sleep(0.3)
            task = asyncio.create_task(_post(session, url, NOT_REPLAYABLE))
            await _until(lambda: ds[0].bodies)  # on the stuck instance now
            ds[0].live_stalled_s = 3.0  # its engine stopped stepping
            status, headers, raw = await asyncio.wait_for(task, 10)
            assert status == 200 and json.loads(raw)["served_by"] == "p0"  # the prefill instance, as mixed
            assert not router.pools.is_healthy(ds[0].url)
            await asyncio.sleep(0.5)
            assert not router.pools.is_healthy(ds[0].url)  # /health answers, but /live says it is stuck
            ds[0].live_stalled_s = 0.0  # it steps again
            await _until(lambda: router.pools.is_healthy(ds[0].url))
            fallbacks = router.metrics.registry.get_sample_value(
                "vllm:disagg_router_fallbacks_total", {"reason": "reroute_left_routing"})
            assert fallbacks == 1
    run(scenario())


def test_a_started_stream_that_cannot_be_replayed_ends_with_an_error_naming_the_stall():
    async def scenario():
        async with deployment(p_modes=(), d_modes=("stall_mid_stream",), mixed_modes=(), health_interval_s=0.1,
                              stall_timeout_s=0.5, health_failures_to_drop=100) as (url, session, _, ds, _m, router):
            ds[0].live_stalled_s = 0.0
            await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "echo": True, "stream": True}
            task = asyncio.create_task(_post(session, url, body))
            await _until(lambda: ds[0].bodies)
            await asyncio.sleep(0.2)
            ds[0].live_stalled_s = 3.0
            status, _, raw = await asyncio.wait_for(task, 10)
            assert status == 200 and b"left routing" in raw and b"cannot be continued" in raw
            assert raw.rstrip().endswith(b"data: [DONE]")
    run(scenario())


def test_past_max_waiting_a_new_request_gets_503_with_retry_after_at_once():
    async def scenario():
        async with deployment(p_modes=(), d_modes=("ok",), health_interval_s=0.1, max_waiting=1,
                              admission_wait_s=20) as (url, session, _, ds, _m, router):
            ds[0].healthy = False  # restarting
            await _until(lambda: not router.pools.is_healthy(ds[0].url))
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
            waiting = asyncio.create_task(_post(session, url, body))
            await _until(lambda: router.proxy.num_waiting == 1)
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "2"
                assert "--max-waiting" in (await resp.json())["error"]["message"]
            ds[0].healthy = True
            status, _, _ = await asyncio.wait_for(waiting, 10)
            assert status == 200 and router.proxy.num_waiting == 0
    run(scenario())


def test_an_idle_instance_polled_long_ago_owes_progress_only_from_its_first_booking():
    """The watchdog extrapolates from the last poll; an instance that had nothing to do since then is
    not stalled the moment a request lands on it (with 1 s polls and a 1 s limit it was cut at once)."""
    config = RouterConfig(mixed_urls=["http://127.0.0.1:1"], stall_timeout_s=0.5)
    router = Router(config)
    inst = router.pools.instances["http://127.0.0.1:1"]
    now = time.monotonic()
    inst.last_progress = now - 5.0  # its last good poll, 5 s ago
    assert router.health.check_stalls(now) == []  # idle: owes nothing
    router.pools.route(10, 5)
    assert router.health.check_stalls(now + 0.3) == []
    assert router.health.check_stalls(now + 0.7) == [inst]


def test_a_long_prefill_step_is_not_cut_at_the_fixed_limit_but_past_its_margin():
    """An instance whose `/live` expects an 8 s step (a long prompt's prefill, one engine step) is cut
    past 3 x 8 s, not at the fixed 10 s, both as the only instance and with another to take over;
    one stepping every 50 ms keeps the adaptive 2 s."""
    from vllm_disagg.liveness import LONG_STEP_MARGIN

    for urls in (["http://127.0.0.1:1"], ["http://127.0.0.1:1", "http://127.0.0.1:2"]):
        router = Router(RouterConfig(mixed_urls=urls, stall_timeout_s=10, stall_factor=5, stall_min_s=2))
        now = time.monotonic()
        for inst in router.pools.instances.values():
            assert router.health._take_report(inst, {"stalled_s": 0.0, "expected_step_s": 8.0}, now) == 0.0
        inst = router.pools.route(2048, 5).target
        assert router.health.check_stalls(now + 12) == []  # past --stall-timeout-s 10
        assert router.health.check_stalls(now + LONG_STEP_MARGIN * 8 + 1) == [inst]
    assert router.health.stall_limit(0.05) == 2.0


def test_a_long_step_whose_layers_report_is_cut_at_the_fixed_limit():
    """The same 8 s step, with its layers reporting (`expected_progress_s` 0.27 s, 30 layers): no margin
    is needed, so a hang inside it is cut at the fixed 10 s, not at 3 x 8 s. An instance that reports
    no `expected_progress_s` (an older one) keeps the step's margin."""
    for urls in (["http://127.0.0.1:1"], ["http://127.0.0.1:1", "http://127.0.0.1:2"]):
        router = Router(RouterConfig(mixed_urls=urls, stall_timeout_s=10, stall_factor=5, stall_min_s=2))
        now = time.monotonic()
        report = {"stalled_s": 0.0, "expected_step_s": 8.0, "expected_progress_s": 8.0 / 30, "layer_progress": True}
        for inst in router.pools.instances.values():
            router.health._take_report(inst, report, now)
        inst = router.pools.route(2048, 5).target
        assert router.health.check_stalls(now + 9.5) == []
        assert router.health.check_stalls(now + 10.5) == [inst]
        assert router.health.stall_limit(8.0, 8.0 / 30) == 10.0 and router.health.stall_limit(8.0) == 24.0


def test_a_request_on_a_suspect_instance_moves_before_its_first_token_and_the_instance_stays():
    """m0 steps every 50 ms, then owes progress for 1 s: past the soft limit (0.3 s) its request, which
    showed the client nothing, is replayed on m1 while m0 stays in routing (its stall limit is 20 s);
    a new request avoids m0 while it is suspect, and m0 is trusted again once it steps."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("stall", "ok"), health_interval_s=0.1,
                              stall_timeout_s=20, stall_factor=5, stall_min_s=20, stall_release_s=0.3) as (
                url, session, _, _d, ms, router):
            ms[0].live_expected_step_s = 0.05
            await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": [4, 2], "max_tokens": 3, "stream": True, "return_token_ids": True}
            task = asyncio.create_task(_post(session, url, body))
            await _until(lambda: len(ms[0].bodies) == 1)
            ms[0].live_stalled_s = 1.0
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200 and _stream_ids(raw) == _expected([4, 2], 3) and len(ms[1].bodies) == 1
            assert 'reason="stalled_release"' in _replay_reasons(router)
            assert router.pools.is_healthy(ms[0].url)  # moved off, not cut
            assert router.pools.is_suspect(ms[0].url)  # its engine still reports the stall
            status, _, raw = await asyncio.wait_for(_post(session, url, body), 5)
            assert status == 200 and len(ms[0].bodies) == 1 and len(ms[1].bodies) == 2  # avoided m0
            ms[0].live_stalled_s = 0.0  # it steps again
            await _until(lambda: not router.pools.is_suspect(ms[0].url))
    run(scenario())


def test_an_instance_whose_model_worker_recovers_a_lost_attention_server_leaves_routing_at_once():
    """m0's /live says its model worker is rebuilding a lost attention server's KV (no step ends until a
    replacement answers, seconds): at the next poll, long before any stall limit (20 s), it leaves
    routing, its request replays on m1, and new requests go to m1 until the recovery is over."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("stall", "ok"), health_interval_s=0.1,
                              stall_timeout_s=20, stall_factor=5, stall_min_s=20, stall_release_s=10) as (
                url, session, _, _d, ms, router):
            await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": [4, 2], "max_tokens": 3, "stream": True, "return_token_ids": True}
            task = asyncio.create_task(_post(session, url, body))
            await _until(lambda: len(ms[0].bodies) == 1)
            ms[0].live_recovering_s = 0.4
            t0 = asyncio.get_running_loop().time()
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200 and _stream_ids(raw) == _expected([4, 2], 3) and len(ms[1].bodies) == 1
            assert asyncio.get_running_loop().time() - t0 < 1.0
            assert not router.pools.is_healthy(ms[0].url)
            await asyncio.sleep(0.3)  # polls see it recovering: it stays out
            assert not router.pools.is_healthy(ms[0].url)
            status, _, raw = await asyncio.wait_for(_post(session, url, body), 5)
            assert status == 200 and len(ms[0].bodies) == 1 and len(ms[1].bodies) == 2
            ms[0].live_recovering_s = None  # recovered
            await _until(lambda: router.pools.is_healthy(ms[0].url))
    run(scenario())


def test_the_only_instance_recovering_an_attention_server_keeps_its_request_until_it_is_done():
    """With no other instance to take them, a recovering instance stays in routing (suspect): its
    request waits for the recovery and is answered there, not cut and left waiting for a rejoin."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("paused",), health_interval_s=0.1,
                              stall_timeout_s=20, stall_factor=5, stall_min_s=20, stall_release_s=10) as (
                url, session, _, _d, ms, router):
            await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": [4, 2], "max_tokens": 3, "return_token_ids": True}
            task = asyncio.create_task(_post(session, url, body))
            await _until(lambda: len(ms[0].bodies) == 1)
            ms[0].live_recovering_s = 0.4
            await _until(lambda: router.pools.is_suspect(ms[0].url))
            await asyncio.sleep(0.3)
            assert router.pools.is_healthy(ms[0].url) and not task.done()
            ms[0].live_recovering_s = None
            ms[0].resume.set()
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == _expected([4, 2], 3)
            assert _replay_reasons(router) == "" and len(ms[0].bodies) == 1
            await _until(lambda: not router.pools.is_suspect(ms[0].url))
    run(scenario())


def test_an_instance_whose_live_endpoint_stops_answering_is_suspect_within_the_probe_timeout():
    """A SIGSTOPped instance answers nothing, so only the router's extrapolation says it stalled: a
    /live probe that gets no answer in 1 s confirms it, long before the health poll times out."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("stall", "ok"), health_interval_s=0.1,
                              health_timeout_s=5, stall_timeout_s=20, stall_factor=5, stall_min_s=20,
                              stall_release_s=0.3) as (url, session, _, _d, ms, router):
            ms[0].live_expected_step_s = 0.05
            await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": [4, 2], "max_tokens": 3, "stream": True, "return_token_ids": True}
            task = asyncio.create_task(_post(session, url, body))
            await _until(lambda: len(ms[0].bodies) == 1)
            ms[0].frozen = True
            t0 = asyncio.get_running_loop().time()
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200 and _stream_ids(raw) == _expected([4, 2], 3) and len(ms[1].bodies) == 1
            assert asyncio.get_running_loop().time() - t0 < 2.5  # the poll alone would wait 5 s
            assert 'reason="stalled_release"' in _replay_reasons(router)
            ms[0].frozen = False
    run(scenario())


def test_an_idle_instance_whose_health_poll_goes_unanswered_is_suspect_and_new_requests_avoid_it():
    """A SIGSTOPped instance with nothing booked owes no progress, so only its unanswered health poll
    shows it: past the probe timeout it is suspect, new requests go to the other instance at once, not
    after a soft limit and a probe each, and its next answer clears it."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok", "ok"), health_interval_s=0.1,
                              health_timeout_s=5, stall_timeout_s=20, stall_factor=5, stall_min_s=20,
                              stall_release_s=0.3) as (url, session, _, _d, ms, router):
            await asyncio.sleep(0.3)
            ms[0].frozen = True
            t0 = asyncio.get_running_loop().time()
            await _until(lambda: router.pools.is_suspect(ms[0].url), 3)
            assert asyncio.get_running_loop().time() - t0 < 1.6 and router.pools.is_healthy(ms[0].url)
            for prompt in ([4, 2], [5, 1], [6, 3]):
                body = {"model": "m", "prompt": prompt, "max_tokens": 3, "return_token_ids": True}
                status, _, raw = await asyncio.wait_for(_post(session, url, body), 1.0)
                assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == _expected(prompt, 3)
            assert not ms[0].bodies and len(ms[1].bodies) == 3 and _replay_reasons(router) == ""
            ms[0].frozen = False
            await _until(lambda: not router.pools.is_suspect(ms[0].url), 3)
    run(scenario())


def test_a_busy_instance_whose_health_poll_is_slow_but_that_streams_is_not_suspect():
    """/health late by more than the probe timeout on an instance whose tokens flow is a busy API
    server, not a stopped one: its stream is neither moved nor replayed."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok", "ok"), health_interval_s=0.1,
                              health_timeout_s=5, stall_timeout_s=20, stall_factor=5, stall_min_s=20,
                              stall_release_s=0.3) as (url, session, _, _d, ms, router):
            ms[0].live_expected_step_s, ms[0].num_tokens, ms[0].token_gap_s = 0.05, 40, 0.05
            await asyncio.sleep(0.3)
            ms[0].health_delay_s = 1.5
            await asyncio.sleep(0.2)
            body = {"model": "m", "prompt": [4, 2], "max_tokens": 40, "stream": True, "return_token_ids": True}
            status, _, raw = await asyncio.wait_for(_post(session, url, body), 10)
            assert status == 200 and _stream_ids(raw) == _expected([4, 2], 40)
            assert not ms[1].bodies and _replay_reasons(router) == ""
            assert not router.pools.is_suspect(ms[0].url)
    run(scenario())


def test_a_cold_instance_that_answers_is_left_to_the_fixed_limit_and_one_that_does_not_is_suspect():
    """/live has no `expected_step_s` yet (a cold or just restarted engine): its own report of a stall
    past the floor (a first forward of 2 s on a loaded box) marks nothing, while a /live that does not
    answer (SIGSTOP) marks it at the floor, and its request moves long before the fixed limit."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("stall", "ok"), health_interval_s=0.1,
                              health_timeout_s=5, stall_timeout_s=20, stall_factor=5, stall_min_s=0.6,
                              stall_release_s=0.3) as (url, session, _, _d, ms, router):
            await asyncio.sleep(0.3)
            body = {"model": "m", "prompt": [4, 2], "max_tokens": 3, "return_token_ids": True}
            task = asyncio.create_task(_post(session, url, body))
            await _until(lambda: len(ms[0].bodies) == 1)
            ms[0].live_stalled_s = 1.5
            await asyncio.sleep(1.5)
            assert not task.done() and not router.pools.is_suspect(ms[0].url) and not ms[1].bodies
            ms[0].frozen = True
            t0 = asyncio.get_running_loop().time()
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == _expected([4, 2], 3)
            assert asyncio.get_running_loop().time() - t0 < 2.0 and router.pools.is_healthy(ms[0].url)
            assert 'reason="stalled_release"' in _replay_reasons(router)
            ms[0].frozen = False
    run(scenario())


def test_an_instance_no_other_could_replace_is_cut_only_at_the_fixed_limit():
    """The only instance owes progress past its adaptive limit (5 x 50 ms): cutting it would move its
    request nowhere, and then cost a rejoin and a re-prefill once it steps again (the 1P+1D soak, P
    stopped while D restarted). It stays routed until the fixed limit, and answers once continued."""
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("paused",), health_interval_s=0.1,
                              stall_timeout_s=5, stall_factor=5, stall_min_s=0.5, stall_release_s=0.3) as (
                url, session, _, _d, ms, router):
            task = await _stalled_after_fast_steps(session, url, ms[0])
            await asyncio.sleep(1.5)
            assert router.pools.is_healthy(ms[0].url) and not task.done()
            ms[0].live_stalled_s = 0.0
            ms[0].resume.set()  # SIGCONT
            status, _, raw = await asyncio.wait_for(task, 5)
            assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] == _expected([4, 2], 3)
            assert _replay_reasons(router) == "" and len(ms[0].bodies) == 1
    run(scenario())


def test_while_the_only_prefill_instance_is_suspect_decode_serves_new_requests_whole():
    async def scenario():
        async with deployment(p_modes=("ok",), d_modes=("ok",), health_interval_s=30, stall_factor=5) as (
                url, session, ps, ds, _, router):  # no poll in the test's time: one would clear the mark
            router.pools.set_suspect(ps[0].url, True)  # as health.suspect() leaves it
            status, _, raw = await asyncio.wait_for(_post(session, url, {"model": "m", "prompt": [4, 2],
                                                                         "max_tokens": 3}), 5)
            assert status == 200 and json.loads(raw)["served_by"] == "d0" and not ps[0].bodies
            router.pools.set_suspect(ps[0].url, False)
            status, _, raw = await asyncio.wait_for(_post(session, url, {"model": "m", "prompt": [4, 2],
                                                                         "max_tokens": 3}), 5)
            assert status == 200 and len(ps[0].bodies) == 1  # the P/D path again
    run(scenario())


@pytest.mark.parametrize(("flags", "factor"), [([], 5.0), (["--stall-factor", "0"], None),
                                               (["--stall-factor", "off"], None), (["--stall-factor", "3"], 3.0)])
def test_adaptive_detection_is_on_by_default_and_0_turns_it_off(flags, factor):
    from vllm_disagg.router.cli import add_router_args, config_from_args

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(["--decode", "http://127.0.0.1:8200", *flags])
    assert config_from_args(args).stall_factor == factor


def test_a_stall_factor_of_1_or_less_is_refused_with_the_flag_named(capsys):
    from vllm_disagg.router.cli import add_router_args

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--stall-factor", "0.5"])
    assert "--stall-factor must be above 1" in capsys.readouterr().err
