# SPDX-License-Identifier: Apache-2.0
"""`LiveMiddleware`, the ASGI middleware vLLM's API server loads (`vllm serve --middleware
vllm_disagg.liveness.LiveMiddleware`): `GET /live`, `/health` 503 while stalled, generate requests
counted in and out of `LiveState`, and the body cap.

The body cap refuses (413) a request body past `VLLM_DISAGG_MAX_BODY_MB` (default 64, the router's own
limit) before reading it: vLLM buffers any body and parses it on the event loop that answers `/live`, so
an 80 MB one stalled `/live` past the router's probe and marked a healthy instance suspect (the chaos
soak's huge-body fault).
"""

from __future__ import annotations

import json
import os

from vllm_disagg.liveness.state import live_state

__all__ = ["ENV_MAX_BODY_MB", "MAX_BODY_BYTES", "LiveMiddleware", "max_body_bytes"]

ENV_MAX_BODY_MB = "VLLM_DISAGG_MAX_BODY_MB"
MAX_BODY_BYTES = 64 << 20
"""The largest request body an instance (and the router) reads; a 128k-token prompt is ~1 MB of JSON."""


class LiveMiddleware:
    """ASGI middleware for vLLM's API server: `GET /live`, `/health` 503 while stalled, and the body cap
    that keeps `/live` answering (module docstring)."""

    def __init__(self, app) -> None:
        self.app = app
        self.state = live_state()
        self.max_body_bytes = max_body_bytes()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            return await _respond(send, 413, _too_large(self.max_body_bytes))
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            receive = _CappedReceive(receive, send, self.max_body_bytes)
            try:
                await self._route(scope, receive, receive.send)
            except Exception:
                if not receive.over:  # the app's own failure; past the cap it is the "client gone" we faked
                    raise
            return await receive.refuse_if_over()
        return await self._route(scope, receive, send)

    async def _route(self, scope, receive, send):
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == "/live" and method == "GET":
            report = self.state.report()
            return await _respond(send, 200 if report["live"] else 503, report)
        if path == "/health":
            report = self.state.report()
            if not report["live"]:
                return await _respond(send, 503, {"error": f"engine made no progress for {report['stalled_s']:.1f} s "
                                                           "with work pending", **report})
            return await self.app(scope, receive, send)
        if method != "POST" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        state, answered, gone, request_id, status = self.state, False, False, None, 200

        async def counting_receive():
            nonlocal request_id, gone
            message = await receive()
            if request_id is None and message.get("type") == "http.request" and not message.get("more_body"):
                request_id = state.request_started()  # owed from the body's end: a slow upload is not a stall
            gone = gone or message.get("type") == "http.disconnect"
            return message

        async def counting_send(message):
            nonlocal answered, status
            if message.get("type") == "http.response.start":
                status = int(message.get("status", 200))
            elif message.get("type") == "http.response.body":
                if message.get("body") and status < 400 and not gone:
                    state.chunk_sent()  # an error (an abort's reply to a client that left) is no engine progress
                # after the client left, the server drops what is sent: an abort's error reply is no answer
                answered = answered or (not gone and not message.get("more_body", False))
            await send(message)

        try:
            return await self.app(scope, counting_receive, counting_send)
        finally:
            if request_id is not None:
                state.request_ended(request_id, answered)


def max_body_bytes() -> int:
    """`VLLM_DISAGG_MAX_BODY_MB` in bytes (default MAX_BODY_BYTES); a bad value stops the start."""
    raw = os.environ.get(ENV_MAX_BODY_MB, "").strip()
    if not raw:
        return MAX_BODY_BYTES
    try:
        mib = float(raw)
    except ValueError:
        mib = 0.0
    if mib <= 0:
        raise ValueError(f"{ENV_MAX_BODY_MB}={raw!r}: expected a positive number of MiB")
    return int(mib * (1 << 20))


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length itself
    return None


def _too_large(limit: int) -> dict:
    message = (f"request body larger than {limit / (1 << 20):g} MiB ({ENV_MAX_BODY_MB}); nothing of it was "
               "processed")
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 413}}


class _CappedReceive:
    """A body sent without Content-Length (chunked): once past the limit the app sees the client leave,
    and the client gets the 413 (unless the app answered first)."""

    def __init__(self, receive, send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.num_bytes, self.over, self.started = 0, False, False

    async def __call__(self):
        if self.over:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message.get("type") == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > self.limit:
                self.over = True
                return {"type": "http.disconnect"}
        return message

    async def send(self, message) -> None:
        if self.over and not self.started:
            return  # the app's answer to a client it thinks left: the 413 goes out instead
        self.started = self.started or message.get("type") == "http.response.start"
        await self._send(message)

    async def refuse_if_over(self) -> None:
        if self.over and not self.started:
            await _respond(self._send, 413, _too_large(self.limit))


async def _respond(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
