# SPDX-License-Identifier: Apache-2.0
"""Helpers of the observability tests against real deployments: one traced request and its trace,
the router's answers to every route of plain vLLM's OpenAPI schema, and live metric names."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

from vllm_disagg.observe.collector import SpanCollector
from vllm_disagg.observe.waterfall import Trace, find_trace

# Processes export every 200 ms instead of every 5 s (OTel's BatchSpanProcessor default).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
PD_SPANS = ("router.request", "kv.push", "kv.receive", "kv.wait", "decode", "prefill.compute")


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout_s: float = 300) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def pd_trace(endpoint: str, collector: SpanCollector, body: dict[str, Any], request_id: str,
             names: tuple[str, ...] = PD_SPANS, timeout_s: float = 30,
             processes: frozenset[str] = frozenset()) -> Trace:
    """Send one request with `X-Request-Id`, then wait until its trace holds every span in `names`,
    both engines' `llm_request` (vLLM's own span) and spans of every process in `processes`: each
    process exports on its own schedule, so one span name seen is not every process's spans seen."""
    status, raw, headers = post(f"{endpoint}/v1/completions", body, {"X-Request-Id": request_id})
    assert status == 200 and headers.get("X-Request-Id") == request_id, (status, raw[:500])

    def complete(spans: list) -> bool:
        t = find_trace(spans, request_id)
        return (t is not None and set(names) <= {s["name"] for s in t.spans}
                and len(t.named("llm_request")) >= 2 and processes <= _process_names(t))

    if not collector.wait_for(complete, timeout_s):
        t = find_trace(collector.spans, request_id)
        raise AssertionError(f"trace of {request_id} incomplete after {timeout_s} s: "
                             f"{sorted(s['name'] for s in t.spans) if t else 'no trace'}, "
                             f"processes {sorted(_process_names(t)) if t else []}")
    return find_trace(collector.spans, request_id)


def _process_names(t: Trace) -> set[str]:
    """The trace's processes without their pids (`vllm-disagg-decode0/EngineCore`)."""
    return {p.rsplit(":", 1)[0] for p in t.processes}


def _request_for(method: str, path: str, model: str) -> dict[str, Any] | None:
    """A body that plain vLLM accepts for the routes where one is easy, else {} (a validation error
    both sides must answer alike)."""
    if method != "POST":
        return None
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    return {
        "/tokenize": {"model": model, "prompt": "hello world"},
        "/detokenize": {"model": model, "tokens": [1, 2, 3]},
        "/v1/completions": {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0},
        "/v1/chat/completions": chat,
        "/v1/messages": chat,
        "/v1/messages/count_tokens": {"model": model, "messages": chat["messages"]},
    }.get(path, {})


_SAME_BODY = ("/tokenize", "/detokenize", "/version", "/v1/messages/count_tokens")


def api_surface_mismatches(router: str, baseline: str, model: str) -> list[str]:
    """Every (method, path) of the baseline's OpenAPI schema whose status (and, for deterministic
    routes, body) differs between the router and plain vLLM."""
    schema = json.load(urllib.request.urlopen(f"{baseline}/openapi.json", timeout=30))
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops]
    assert {("POST", "/tokenize"), ("GET", "/v1/models"), ("GET", "/version")} <= set(routes), routes
    bad = []
    for method, path in sorted(routes):
        concrete = re.sub(r"\{[^}]+\}", "resp_missing", path)
        body = _request_for(method, path, model)
        got = [_call(base + concrete, method, body) for base in (router, baseline)]
        (r_status, r_body), (b_status, b_body) = got
        if r_status != b_status or (path in _SAME_BODY and r_body != b_body):
            bad.append(f"{method} {path}: router {r_status} {r_body[:200]!r}, vllm {b_status} {b_body[:200]!r}")
    return bad


def _call(url: str, method: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def scraped_names(urls: list[str]) -> set[str]:
    from vllm_disagg.testing.monitoring import scraped_families

    names: set[str] = set()
    for url in urls:
        names |= scraped_families(urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode())
    return names

