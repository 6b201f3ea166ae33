# SPDX-License-Identifier: Apache-2.0
"""The instance middleware's body cap, on a real uvicorn server (vLLM's own HTTP server) with a FastAPI
app that parses the body as vLLM's does: a body past the cap is refused with 413 before it is read
(an announced length) or once the cap passes (chunked), so `/live` keeps answering; a body under it
reaches the app untouched."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import uuid

import pytest
import uvicorn
from fastapi import FastAPI, Request

from vllm_disagg.launch.instances import free_ports
from vllm_disagg.liveness import ENV_MAX_BODY_MB, LiveMiddleware, max_body_bytes

MIB = 1 << 20


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("VLLM_DISAGG_LIVE_SOCKET", f"vd-body-test-{uuid.uuid4().hex}")
    monkeypatch.setenv(ENV_MAX_BODY_MB, "1")
    monkeypatch.setattr("vllm_disagg.liveness.state._STATE", None)
    app = FastAPI()
    seen = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(len(body["prompt"]))
        return {"num_chars": len(body["prompt"])}

    app.add_middleware(LiveMiddleware)
    port = free_ports(1)[0]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield port, seen
    srv.should_exit = True
    thread.join(timeout=5)


def _post(port: int, body, headers: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json", **headers},
                     encode_chunked="Transfer-Encoding" in headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def test_a_body_announced_past_the_cap_is_refused_before_a_byte_of_it_is_read(server):
    port, seen = server
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{\"prompt\": \"" % (80 * MIB))  # 80 MiB announced, none sent
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:80]
    assert b"larger than 1 MiB" in head and time.monotonic() - t0 < 2.0 and not seen


def test_a_chunked_body_past_the_cap_gets_a_413_and_never_reaches_the_app(server):
    port, seen = server
    chunks = (b'{"prompt": "' + b"a" * (256 << 10) if i == 0 else b"a" * (256 << 10) for i in range(8))
    status, answer = _post(port, chunks, {"Transfer-Encoding": "chunked"})
    assert status == 413 and "nothing of it was processed" in answer["error"]["message"] and not seen


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_under_the_cap_reaches_the_app_whole(server, chunked):
    port, seen = server
    body = json.dumps({"prompt": "a" * (512 << 10)}).encode()
    headers = {"Transfer-Encoding": "chunked"} if chunked else {}
    status, answer = _post(port, iter([body[:1000], body[1000:]]) if chunked else body, headers)
    assert status == 200 and answer == {"num_chars": 512 << 10} and seen == [512 << 10]


def test_a_bad_cap_stops_the_start_with_its_name(monkeypatch):
    monkeypatch.setenv(ENV_MAX_BODY_MB, "lots")
    with pytest.raises(ValueError, match=f"{ENV_MAX_BODY_MB}='lots'"):
        max_body_bytes()
    monkeypatch.setenv(ENV_MAX_BODY_MB, "0.5")
    assert max_body_bytes() == MIB // 2
