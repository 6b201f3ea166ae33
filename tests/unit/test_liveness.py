# SPDX-License-Identifier: Apache-2.0
"""The stuck-step watchdog's two halves: EngineCore's beats and the API server's `/live` verdict,
over a real abstract unix socket and the real ASGI middleware (driven by hand, no server)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import pytest

from vllm_disagg.liveness import (
    LONG_STEP_MARGIN,
    LayerBeacon,
    LiveMiddleware,
    LiveState,
    StepBeacon,
    stall_limit_for,
)


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def state(monkeypatch):
    name = f"vd-live-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("VLLM_DISAGG_LIVE_SOCKET", name)
    monkeypatch.setenv("VLLM_DISAGG_STALL_TIMEOUT_S", "0.3")
    return LiveState(name), StepBeacon(name)


def test_no_beats_means_unknown_never_stalled(state):
    live, _ = state
    live.request_started()
    time.sleep(0.35)
    report = live.report()
    assert report["stalled_s"] is None and report["live"] and report["inflight"] == 1


def test_work_without_engine_steps_is_a_stall_and_a_step_or_a_chunk_is_progress(state):
    live, beacon = state
    beacon.beat(0)
    _until(lambda: live.num_beats == 1)
    assert live.report()["stalled_s"] == 0.0  # idle: nothing in flight
    live.request_started()
    time.sleep(0.35)
    assert live.report()["stalled_s"] >= 0.3 and not live.report()["live"]
    beacon.beat(16)  # a step started: progress
    _until(lambda: live.num_beats == 2)
    assert live.report()["stalled_s"] < 0.1 and live.report()["engine_busy"]
    time.sleep(0.35)
    live.chunk_sent()  # a streamed token went out
    assert live.report()["live"]
    live.request_ended()
    beacon.beat(0)  # the engine's last step: nothing scheduled
    _until(lambda: not live.engine_busy)
    time.sleep(0.35)
    assert live.report()["stalled_s"] == 0.0  # idle: never stalled


def test_beats_are_rate_limited_but_an_idle_busy_change_always_goes_out(state):
    live, beacon = state
    for _ in range(50):
        beacon.beat(8)
    beacon.beat(0)
    _until(lambda: live.num_beats == 2)
    time.sleep(0.05)
    assert live.num_beats == 2 and not live.engine_busy
    beacon.beat(8)
    beacon.beat(8)
    beacon.beat(400)  # a much bigger step (a prefill after decodes) always goes out: it sets the expected time
    _until(lambda: live.num_beats == 4)
    assert live.num_step_tokens == 400


def test_a_beacon_with_nobody_listening_costs_nothing_and_never_raises():
    beacon = StepBeacon(f"vd-nobody-{os.getpid()}")
    for n in (0, 5, 0):
        beacon.beat(n)
    beacon.close()


async def _call(app, path, method="GET"):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    await app({"type": "http", "path": path, "method": method}, receive, send)
    return sent


def test_the_middleware_answers_live_and_fails_health_while_stalled(state, monkeypatch):
    live, beacon = state
    monkeypatch.setattr("vllm_disagg.liveness.state._STATE", live)
    release = asyncio.Event()

    async def engine_app(scope, receive, send):
        if scope["path"] == "/v1/completions":
            await receive()  # the request body, as vLLM's handler reads it first
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = LiveMiddleware(engine_app)

    async def scenario():
        beacon.beat(0)
        await asyncio.sleep(0.05)
        assert (await _call(app, "/health"))[0]["status"] == 200
        task = asyncio.create_task(_call(app, "/v1/completions", "POST"))
        await asyncio.sleep(0.4)  # in flight, no beat: stalled past 0.3 s
        live_msgs = await _call(app, "/live")
        assert live_msgs[0]["status"] == 503 and json.loads(live_msgs[1]["body"])["inflight"] == 1
        health = await _call(app, "/health")
        assert health[0]["status"] == 503 and b"no progress" in health[1]["body"]
        release.set()
        await task
        beacon.beat(0)
        await asyncio.sleep(0.05)
        assert live.inflight == 0 and (await _call(app, "/live"))[0]["status"] == 200
        assert (await _call(app, "/v1/models"))[1]["body"] == b"ok"  # GETs pass through, uncounted

    asyncio.run(scenario())


def test_a_stuck_engine_stays_stalled_after_its_requests_were_cut_until_it_steps_again(state):
    live, beacon = state
    beacon.beat(0)
    _until(lambda: live.num_beats == 1)
    live.request_started()
    time.sleep(0.35)
    live.request_ended()  # the router cut it: the client connection closed, nothing in flight
    assert live.report()["stalled_s"] >= 0.3 and not live.report()["live"]
    beacon.beat(0)  # SIGCONT: the engine steps again
    _until(lambda: live.num_beats == 2)
    assert live.report()["stalled_s"] == 0.0 and live.report()["live"]


def test_a_step_with_tokens_that_never_ends_is_a_stall_even_with_no_request_in_flight(state):
    live, beacon = state
    beacon.beat(32)
    _until(lambda: live.num_beats == 1)
    time.sleep(0.35)
    assert live.report()["stalled_s"] >= 0.3


def test_expected_step_time_is_learned_from_busy_beats_and_scaled_to_the_step_in_progress(state):
    """Beats are step starts: 10 busy steps of 4 tokens 50 ms apart say a 4-token step takes 50 ms and a
    400-token one up to 5 s (never faster per token than seen); idle gaps are not steps."""
    live, _ = state
    live.beat(0, 100.0)
    assert live.report()["expected_step_s"] is None
    t = 100.0
    for _ in range(10):
        t += 0.05
        live.beat(4, t)
    live.beat(0, t + 0.05)
    live.beat(4, t + 30.0)  # after 30 s idle: not a 30 s step
    assert live.expected_step_s() == pytest.approx(0.05)
    live.beat(400, t + 30.05)
    assert live.expected_step_s() == pytest.approx(5.0)
    live.beat(1, t + 30.1)  # a 400-token step took 50 ms: now that is the most optimistic sample
    live.beat(400, t + 30.15)
    assert live.expected_step_s() == pytest.approx(0.05)


def test_beats_read_together_still_measure_their_steps_by_when_they_were_sent(state):
    """A busy API server reads queued beats in a burst (here: its listener waits on the lock). By arrival
    time those steps took 0 s, so a Ray decode instance reported `expected_step_s` 0 and the router never
    applied its adaptive limit; each beat carries the step's start instead."""
    live, beacon = state
    with live._lock:  # the listener thread blocks in beat(): the datagrams queue in the socket
        for num_tokens in (0, 4, 4, 4, 4):
            beacon.beat(num_tokens)
            time.sleep(0.06)  # past the beacon's 50 ms gap: every beat goes out
    _until(lambda: live.num_beats == 5)
    assert live.expected_step_s() == pytest.approx(0.06, abs=0.03)


def test_a_step_under_a_millisecond_is_no_sample(state):
    live, _ = state
    t = 100.0
    for gap in (0.0, 0.05, 0.05, 0.05, 0.0, 0.00001):  # the first beat starts the count
        t += gap
        live.beat(4, t)
    assert live.report()["num_step_samples"] == 3 and live.expected_step_s() == pytest.approx(0.05)


def test_a_step_expected_to_be_long_is_live_past_the_fixed_timeout_and_stalled_past_its_margin(state):
    """A 1920-token prefill after 512-token ones: one engine step of seconds, no beat until it ends
    (the fixed 0.3 s timeout here stands for 10 s; stop 38 saw a healthy P cut at 10 s)."""
    live, _ = state
    t = time.monotonic() - 10.0
    for _ in range(4):  # 512-token steps of 0.1 s
        live.beat(512, t)
        t += 0.1
    live.beat(2048, t)  # the long step starts: expected 0.4 s
    live.last_beat = time.monotonic() - 0.5  # ... and has run 0.5 s: past 0.3 s, inside 3 x 0.4 s
    report = live.report()
    assert report["expected_step_s"] == pytest.approx(0.4) and report["stalled_s"] >= 0.5 and report["live"]
    live.last_beat = time.monotonic() - 1.3  # past LONG_STEP_MARGIN x 0.4 s: a stall after all
    assert not live.report()["live"]
    assert stall_limit_for(None, 10.0) == 10.0 and stall_limit_for(1.0, 10.0) == 10.0
    assert stall_limit_for(8.0, 10.0) == LONG_STEP_MARGIN * 8.0


def test_layer_reports_are_progress_inside_a_long_step_and_shrink_its_wait_to_one_layer(state):
    """The same long step (expected 0.4 s, fixed timeout 0.3 s), its 4 layers reporting: each report is
    progress, the expected wait is one layer's share (0.1 s), so the fixed limit applies again; a step
    that started and reported no layer yet keeps the whole step's wait."""
    live, _ = state
    t = time.monotonic() - 10.0
    for _ in range(4):
        live.beat(512, t)
        t += 0.1
    live.beat(2048, t)
    live.last_beat = time.monotonic() - 2.0
    beacon = LayerBeacon(live.name, gap_s=0.0)
    beacon.layer_done(2, 4)
    _until(lambda: live.num_layers == 4)
    report = live.report()
    assert report["layer_progress"] and report["stalled_s"] < 0.3 and report["live"]
    assert report["expected_progress_s"] == pytest.approx(0.1) and report["expected_step_s"] == pytest.approx(0.4)
    live.last_layer = time.monotonic() - 0.5  # no layer for 0.5 s: past the fixed 0.3 s, no margin now
    assert not live.report()["live"]
    live.beat(2048, time.monotonic())  # the next step: no layer of it reported yet
    live.last_beat = time.monotonic() - 0.5
    report = live.report()
    assert not report["layer_progress"] and report["expected_progress_s"] == pytest.approx(0.4) and report["live"]


def test_a_layer_beacon_finds_the_api_server_among_its_ancestors_and_is_rate_limited(state):
    """A tensor-parallel worker's API server is its grandparent: the beacon tries both names, keeps the one
    that listens, and sends at most one datagram per gap."""
    live, _ = state
    beacon = LayerBeacon(gap_s=0.0)
    beacon._addrs = ["\0vd-live-test-nobody", "\0" + live.name]
    beacon.layer_done(0, 7)
    _until(lambda: live.num_layers == 7)
    assert beacon._addrs == ["\0" + live.name]
    slow = LayerBeacon(live.name, gap_s=60.0)
    slow.layer_done(0, 9)
    slow.layer_done(1, 11)  # within the gap: not sent
    _until(lambda: live.num_layers == 9)
    time.sleep(0.1)
    assert live.num_layers == 9
    LayerBeacon("vd-live-test-nobody-at-all", gap_s=0.0).layer_done(0, 1)  # nobody listening: no error


def test_a_request_answered_without_the_engine_owes_nothing(state, monkeypatch):
    """A 400 from validation (or a tokenizer call) never reaches an idle engine, which then takes no
    step: found by the chaos soak, where bad HTTP left an idle decode instance 'stalled' (so out of
    routing, so never given the request that would clear it) for 160 s."""
    live, beacon = state
    monkeypatch.setattr("vllm_disagg.liveness.state._STATE", live)

    async def validating_app(scope, receive, send):
        status = 400 if scope["path"].startswith("/v1/") else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"bad", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    app = LiveMiddleware(validating_app)

    async def scenario():
        beacon.beat(0)
        await asyncio.sleep(0.05)
        assert (await _call(app, "/v1/completions", "POST"))[0]["status"] == 400
        await asyncio.sleep(0.35)
        assert (await _call(app, "/health"))[0]["status"] == 200
        assert json.loads((await _call(app, "/live"))[1]["body"])["stalled_s"] == 0.0

    asyncio.run(scenario())


async def _aborted_after_the_client_left() -> None:
    """One generate request through the middleware whose client leaves: vLLM then aborts it and sends
    an error reply (500) that the server drops."""
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]

    async def aborting_app(scope, receive, send):
        await receive()  # the body
        await receive()  # vLLM's disconnect listener: the client left
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"aborted"})

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    await LiveMiddleware(aborting_app)({"type": "http", "path": "/v1/completions", "method": "POST"}, receive, send)


def test_a_reply_sent_after_the_client_left_is_no_answer(state, monkeypatch):
    """The router cuts a request off a SIGSTOPped engine by closing the connection; vLLM then aborts it
    and sends an error reply the server drops. Counted as an answer, that cleared the debt and the
    stopped instance rejoined routing a second after its cut (issue 18, found with a restarted D)."""
    live, beacon = state
    monkeypatch.setattr("vllm_disagg.liveness.state._STATE", live)

    async def scenario():
        beacon.beat(0)
        await asyncio.sleep(0.05)
        await _aborted_after_the_client_left()
        await asyncio.sleep(0.35)
        assert not live.report()["live"]  # owed until the engine steps (no heartbeat here)

    asyncio.run(scenario())


def test_an_abort_reply_to_one_request_is_no_progress_for_the_others(state, monkeypatch):
    """Two routers each had a request on a stopped engine. The first moved its own off at the soft
    limit; vLLM's error reply to that cut request counted as a streamed chunk, so the engine's stall
    clock restarted and the second router saw the stall only 0.5 s later (the 1P+1D Lamina soak's
    slow requests came in pairs 0.52 s apart, issue 18)."""
    live, beacon = state
    monkeypatch.setattr("vllm_disagg.liveness.state._STATE", live)

    async def scenario():
        beacon.beat(0)
        await asyncio.sleep(0.05)
        live.request_started()  # the second router's request, still waiting on the stopped engine
        await asyncio.sleep(0.2)
        await _aborted_after_the_client_left()
        assert live.report()["stalled_s"] >= 0.2

    asyncio.run(scenario())


def test_an_unanswered_request_owes_a_step_only_while_the_engine_process_is_silent(state, monkeypatch):
    """Cut before it was answered: owed until the next step, unless EngineCore's heartbeat shows an
    idle engine that runs (the API server dropped the request before handing it over)."""
    live, beacon = state
    monkeypatch.setattr("vllm_disagg.liveness.beacon.ALIVE_PERIOD_S", 0.1)
    beacon.beat(0)
    _until(lambda: live.num_beats == 1)
    live.request_ended(live.request_started(), answered=False)
    time.sleep(0.35)
    assert not live.report()["live"]  # no heartbeat: a stopped EngineCore looks like this
    beacon.start_heartbeat(period_s=0.05)
    _until(lambda: live.report()["stalled_s"] == 0.0)
    assert live.report()["live"]


def test_a_slowly_uploaded_body_is_not_owed_work_until_it_has_arrived(state, monkeypatch):
    """A client that trickles its body (slowloris) holds a request open for as long as it likes;
    the engine owes nothing until the body is whole, so the instance never looks stalled for it."""
    live, beacon = state
    monkeypatch.setattr("vllm_disagg.liveness.state._STATE", live)
    chunks = [{"type": "http.request", "body": b'{"prompt":', "more_body": True},
              {"type": "http.request", "body": b' "x"}', "more_body": False}]

    async def reading_app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def slow_receive():
        if len(chunks) == 1:
            await asyncio.sleep(0.4)  # past the 0.3 s stall timeout
        return chunks.pop(0)

    async def scenario():
        beacon.beat(0)
        await asyncio.sleep(0.05)
        app = LiveMiddleware(reading_app)
        task = asyncio.create_task(app({"type": "http", "path": "/v1/completions", "method": "POST"},
                                       slow_receive, lambda message: asyncio.sleep(0)))
        await asyncio.sleep(0.35)
        report = json.loads((await _call(app, "/live"))[1]["body"])
        assert report["inflight"] == 0 and report["live"]  # still uploading: nothing owed yet
        await task
        assert live.inflight == 0 and live.report()["stalled_s"] == 0.0  # answered in full

    asyncio.run(scenario())


def test_a_worker_recovering_a_lost_attention_server_is_reported_until_it_is_done(state, monkeypatch):
    """`beacon.recovering()` repeats its datagram while the block runs: `/live` reports `recovering_s`
    (the router moves new requests elsewhere), and the end datagram clears it at once."""
    from vllm_disagg.liveness import beacon

    live, _ = state
    assert live.report()["recovering_s"] is None
    with beacon.recovering(period_s=0.05):
        _until(lambda: live.report()["recovering_s"] is not None)
        time.sleep(0.2)
        assert live.report()["recovering_s"] >= 0.2
    _until(lambda: live.report()["recovering_s"] is None)


def test_a_recovery_its_worker_stopped_repeating_is_forgotten(state, monkeypatch):
    """A worker killed inside its recovery sends no end datagram: past `RECOVERY_STALE_S` without a
    repeat the flag is gone, and the stall watchdog judges the instance as before."""
    from vllm_disagg.liveness import state as state_module

    live, _ = state
    now = time.monotonic()
    live.recovery(True, now - 1.0, now)
    assert live.report()["recovering_s"] >= 1.0
    monkeypatch.setattr(state_module, "RECOVERY_STALE_S", 0.1)
    time.sleep(0.15)
    assert live.report()["recovering_s"] is None
