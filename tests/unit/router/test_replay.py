# SPDX-License-Identifier: Apache-2.0
"""Router replay: continuation bodies, SSE parsing and stitching (pure), then the proxy against real
HTTP instance servers that die mid-stream (`instance_server.py`). Real vLLM: test_model_worker_restart.py."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from instance_server import next_token
from test_router_proxy import _post, _sse_events, deployment, run

from vllm_disagg.router.replay import SSEParser, Stitcher, continuation_body, replayable


# ------------------------------------------------------------------ pure
def test_completion_continuation_goes_on_from_the_generated_tokens_with_a_reduced_budget():
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "min_tokens": 4, "temperature": 0, "seed": 7,
            "prompt_logprobs": 1, "echo": False, "stream": True, "stop": ["x"]}
    out = continuation_body(body, False, [5, 6], [7, 8, 9])
    assert out["prompt"] == [5, 6, 7, 8, 9]
    assert (out["max_tokens"], out["min_tokens"]) == (7, 1)
    assert out["stream"] is True and out["return_token_ids"] is True
    assert "prompt_logprobs" not in out and "echo" not in out
    assert (out["temperature"], out["seed"], out["stop"], out["model"]) == (0, 7, ["x"], "m")


def test_completion_without_max_tokens_continues_against_openais_default_of_16():
    assert continuation_body({"prompt": [1]}, False, [1], [2, 3])["max_tokens"] == 14


def test_chat_continuation_is_a_completions_body_on_the_rendered_prompt_ids():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9,
            "temperature": 0, "stream": True, "tools": None, "stream_options": {"include_usage": True}}
    out = continuation_body(body, True, [1, 2], [3])
    assert out == {"model": "m", "temperature": 0, "stream_options": {"include_usage": True}, "prompt": [1, 2, 3],
                   "max_tokens": 8, "stream": True, "return_token_ids": True}
    unbounded = {"model": "m", "messages": [], "stream": True}
    assert continuation_body(unbounded, True, [1, 2], [3], max_model_len=100)["max_tokens"] == 97


def test_batch_prompts_several_choices_and_echo_are_not_replayed():
    assert replayable({"prompt": [1, 2]}) and replayable({"prompt": "x"}) and replayable({"messages": []})
    assert not replayable({"prompt": ["a", "b"]})
    assert not replayable({"prompt": "x", "n": 2})
    assert not replayable({"prompt": "x", "echo": True})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b), max_size=6),
       st.lists(st.integers(1, 30), max_size=20))
def test_sse_parser_returns_the_same_payloads_whatever_the_chunk_boundaries(payloads, cuts):
    stream = b"".join(b"data: " + p + b"\n\n" + b": comment\n\n" for p in payloads)
    parser, got, pos = SSEParser(), [], 0
    for cut in cuts:
        got += parser.feed(stream[pos:pos + cut])
        pos += cut
    got += parser.feed(stream[pos:])
    assert got == [p.lstrip(b" ") for p in payloads]


def _vllm_chunks(prompt: list[int], tokens: list[int], chat: bool, usage: bool) -> list[bytes]:
    """What vLLM streams with return_token_ids for `prompt` generating `tokens`."""
    out = []
    if chat:
        out.append({"id": f"x{len(prompt)}", "created": len(prompt), "model": "m", "prompt_token_ids": prompt,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    for i, tok in enumerate(tokens):
        finish = "length" if i == len(tokens) - 1 else None
        choice = {"index": 0, "token_ids": [tok], "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": f"<{tok}>"}
        else:
            choice["text"] = f"<{tok}>"
            if i == 0:
                choice["prompt_token_ids"] = prompt
        out.append({"id": f"x{len(prompt)}", "created": len(prompt), "model": "m", "choices": [choice]})
    if usage:
        out.append({"id": f"x{len(prompt)}", "created": len(prompt), "model": "m", "choices": [],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                              "total_tokens": len(prompt) + len(tokens)}})
    return [json.dumps(c).encode() for c in out] + [b"[DONE]"]


@settings(max_examples=80, deadline=None)
@given(prompt=st.lists(st.integers(0, 999), min_size=1, max_size=8), total=st.integers(1, 12),
       cuts=st.lists(st.integers(0, 14), max_size=3), chat=st.booleans(), want_ids=st.booleans(),
       usage=st.booleans())
def test_stitched_stream_shows_one_uninterrupted_answer_whatever_the_failure_points(
        prompt, total, cuts, chat, want_ids, usage):
    full = [(sum(prompt) * 7 + k) % 1000 for k in range(total)]
    body = {"model": "m", "stream": True, "return_token_ids": want_ids, "max_tokens": total,
            **({"messages": []} if chat else {"prompt": prompt})}
    stitch = Stitcher(body, chat)
    client: list[dict] = []
    for cut in [*sorted(cuts), None]:  # each attempt dies after `cut` more chunks (None: runs to the end)
        req, endpoint = stitch.next_request("chat/completions" if chat else "completions")
        done = len(stitch.generated)
        if done:
            assert endpoint == "completions" and req["prompt"] == prompt + full[:done]
            assert req["max_tokens"] == total - done
            chunks = _vllm_chunks(req["prompt"], full[done:], False, usage)
        else:
            chunks = _vllm_chunks(prompt, full, chat, usage)
        for i, data in enumerate(chunks):
            if cut is not None and i >= cut:
                break
            piece = stitch.on_event(data)
            if piece is not None:
                client.append(json.loads(piece[len(b"data: "):]))
        if stitch.finished:
            break
    assert stitch.finished and stitch.generated == full
    choices = [c for ev in client for c in ev["choices"]]
    texts = [c["delta"].get("content") if chat else c["text"] for c in choices]
    assert "".join(t or "" for t in texts) == "".join(f"<{t}>" for t in full)
    assert len({(ev["id"], ev["created"]) for ev in client}) == 1  # one response id throughout
    assert all(ev["object"] == "chat.completion.chunk" for ev in client if chat and "object" in ev)
    if chat:
        assert sum("role" in c["delta"] for c in choices) == 1
    if want_ids:
        assert [t for c in choices for t in c.get("token_ids", [])] == full
        prompts = [ev.get("prompt_token_ids") for ev in client] + [c.get("prompt_token_ids") for c in choices]
        assert [p for p in prompts if p] == [prompt]
    else:
        assert not any("token_ids" in c or "prompt_token_ids" in c for c in choices)
        assert not any("prompt_token_ids" in ev for ev in client)
    for ev in client:
        if "usage" in ev:
            assert ev["usage"]["prompt_tokens"] == len(prompt)
            assert ev["usage"]["total_tokens"] == len(prompt) + total


# ------------------------------------------------------- proxy over HTTP
def _expected(context: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(next_token(context + out))
    return out


def _stream_ids(raw: bytes) -> tuple[list[int], list[dict]]:
    events = _sse_events(raw)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events
    return [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids", [])], events[:-1]


def _replays(router) -> float:
    text = router.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:disagg_router_replays_total{"))


def test_a_stream_whose_instance_dies_mid_answer_continues_on_the_same_instance_once_it_is_back():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1) as (
                url, session, _, _d, ms, router):
            ms[0].num_tokens, ms[0].die_after, ms[0].die_times = 12, 5, 1
            prompt = [3, 1, 4, 1, 5]
            body = {"model": "m", "prompt": prompt, "max_tokens": 12, "stream": True, "return_token_ids": True}
            status, _, raw = await _post(session, url, body)
            ids, events = _stream_ids(raw)
            assert status == 200 and ids == _expected(prompt, 12)
            first, cont = ms[0].bodies
            assert cont["prompt"] == prompt + ids[:5] and cont["max_tokens"] == 7
            assert "prompt_token_ids" in events[0]["choices"][0]
            assert not any("prompt_token_ids" in c for e in events[1:] for c in e["choices"])
            assert _replays(router) == 1
            assert 'reason="mid_stream"' in router.metrics.render().decode()
    run(scenario())


def test_a_dead_decode_instance_is_replaced_by_the_other_one_mid_stream_on_the_push_path():
    async def scenario():
        async with deployment(d_modes=("ok", "ok"), health_interval_s=60) as (url, session, ps, ds, _, router):
            for d in ds:
                d.num_tokens = 9
            ds[0].die_after, ds[0].die_times = 4, 100  # JSQ picks d0 first (both idle); it dies every time
            body = {"model": "m", "prompt": "hello world", "max_tokens": 9, "stream": True}
            status, headers, raw = await _post(session, url, body)
            events = _sse_events(raw)
            assert status == 200 and headers["x-disagg-route"] == "pd" and events[-1] == "[DONE]"
            texts = "".join(e["choices"][0]["text"] for e in events[:-1])
            assert texts == "".join(f" t{t}" for t in _expected(list(b"hello world"), 9))
            assert not any("token_ids" in e["choices"][0] for e in events[:-1])  # the client did not ask
            assert [len(d.bodies) for d in ds] == [1, 1]  # died on d0, finished on d1
            assert ds[1].bodies[0]["prompt"][-4:] == _expected(list(b"hello world"), 4)
            assert [len(p.bodies) for p in ps] == [2]  # the continuation took the push path too
            assert ps[0].bodies[1]["max_tokens"] == 1 and isinstance(ps[0].bodies[1]["prompt"], list)
            assert _replays(router) == 1
    run(scenario())


def test_a_chat_stream_continues_as_completions_and_reaches_the_client_as_chat_chunks():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1) as (
                url, session, _, _d, ms, router):
            ms[0].num_tokens, ms[0].die_after, ms[0].die_times = 8, 3, 1
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8,
                    "stream": True}
            status, _, raw = await _post(session, url, body, "/v1/chat/completions")
            events = _sse_events(raw)
            assert status == 200 and events[-1] == "[DONE]"
            content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
            assert content == "".join(f" t{t}" for t in _expected(list(b"hi"), 8))
            assert {e["object"] for e in events[:-1] if "object" in e} <= {"chat.completion.chunk"}
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert "messages" in ms[0].bodies[0] and "messages" not in ms[0].bodies[1]  # /v1/completions
            assert _replays(router) == 1
    run(scenario())


def test_a_non_streamed_request_answered_with_a_5xx_is_sent_again_and_succeeds_without_dropping_the_instance():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("error_once",), health_interval_s=60) as (
                url, session, _, _d, ms, router):
            status, _, raw = await _post(session, url, {"model": "m", "prompt": [1, 2], "max_tokens": 3})
            assert status == 200 and json.loads(raw)["choices"][0]["text"].count(" t") == 3
            assert len(ms[0].bodies) == 2 and ms[0].bodies[1] == ms[0].bodies[0]
            assert router.pools.is_healthy(ms[0].url)  # it answered: not dropped from routing
            assert 'reason="http_5xx"' in router.metrics.render().decode()
    run(scenario())


def test_when_every_attempt_fails_the_stream_ends_with_a_clear_error_and_never_hangs():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1,
                              replay_attempts=2) as (url, session, _, _d, ms, router):
            ms[0].num_tokens, ms[0].die_after, ms[0].die_times = 10, 2, 100
            status, _, raw = await _post(session, url, {"model": "m", "prompt": [9], "max_tokens": 10,
                                                        "stream": True})
            events = _sse_events(raw)
            assert status == 200 and events[-1] == "[DONE]"
            assert "every attempt" in events[-2]["error"]["message"]
            assert len(ms[0].bodies) == 3 and _replays(router) == 2
    run(scenario())


def test_a_replay_waits_for_a_dropped_instance_to_come_back_within_the_bound():
    async def scenario():
        async with deployment(p_modes=(), d_modes=(), mixed_modes=("ok",), health_interval_s=0.1,
                              replay_wait_s=1.0) as (url, session, _, _d, ms, router):
            ms[0].num_tokens, ms[0].die_after, ms[0].die_times = 6, 2, 1
            ms[0].healthy = False  # "restarting": the replay has to wait

            async def come_back():
                await asyncio.sleep(0.5)
                ms[0].healthy = True
            back = asyncio.create_task(come_back())
            status, _, raw = await _post(session, url, {"model": "m", "prompt": [4, 2], "max_tokens": 6,
                                                        "stream": True, "return_token_ids": True})
            await back
            assert status == 200 and _stream_ids(raw)[0] == _expected([4, 2], 6)
            ms[0].die_times, ms[0].healthy = 1, False  # now it stays down past replay_wait_s
            status, _, raw = await _post(session, url, {"model": "m", "prompt": [4, 2], "max_tokens": 6,
                                                        "stream": True})
            events = _sse_events(raw)
            assert "error" in events[-2] and events[-1] == "[DONE]"
    run(scenario())
