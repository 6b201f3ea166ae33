# SPDX-License-Identifier: Apache-2.0
"""A real tiny HTTP server that answers like a vLLM instance, for router-only logic tests.

It records every body it receives and answers completions with deterministic tokens; `mode` makes it
misbehave the ways a real instance can (error status, stall, die mid-stream). Where a vLLM engine would
add nothing to what a test checks (routing, relaying, timeouts), this stands in for one; equivalence is
tested end to end against real vLLM in tests/integration/test_router_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web


class InstanceServer:
    """One fake instance on 127.0.0.1:<free port>."""

    def __init__(self, name: str, mode: str = "ok", num_tokens: int = 3) -> None:
        self.name, self.mode, self.num_tokens = name, mode, num_tokens
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []
        self.healthy = True
        self.app = web.Application()
        self.app.add_routes([
            web.post("/v1/completions", self._generate),
            web.post("/v1/chat/completions", self._generate),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
        ])
        self._runner = web.AppRunner(self.app, shutdown_timeout=0.5, handler_cancellation=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> InstanceServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _health(self, _req: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _generate(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.bodies.append(body)
        self.arrivals.append(time.monotonic())
        if self.mode == "error":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if self.mode == "stall":
            await asyncio.sleep(3600)
        n = min(self.num_tokens, body.get("max_tokens") or self.num_tokens)
        if body.get("stream"):
            return await self._stream(req, n)
        return web.json_response({"id": "x", "object": "text_completion", "choices": [
            {"index": 0, "text": "".join(f" t{i}" for i in range(n)), "token_ids": list(range(n)),
             "finish_reason": "length"}], "served_by": self.name})

    async def _stream(self, req: web.Request, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "token_ids": [i]}], "served_by": self.name}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)
            if self.mode == "die_mid_stream" and i == 0:
                req.transport.close()  # the process "dies": connection drops mid-stream
                return resp
            if self.mode == "stall_mid_stream" and i == 0:
                await asyncio.sleep(3600)
        await resp.write(b"data: [DONE]\n\n")
        return resp
