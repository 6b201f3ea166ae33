# SPDX-License-Identifier: Apache-2.0
"""A real tiny HTTP server that answers like a vLLM instance, for router-only logic tests.

It records every body it receives and answers completions with deterministic tokens that depend on the whole context (so a
continuation of prompt + generated tokens goes on exactly), with vLLM's `return_token_ids` fields and a
finish_reason on the last chunk; `mode`/`die_after` make it misbehave the ways a real instance can (error status, stall, die mid-stream). Where a vLLM engine would
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
        self.die_after: int | None = None
        """Streams drop the connection after this many tokens, `die_times` times."""
        self.die_times = 0
        self.live_stalled_s: float | None = 0.0
        """What GET /live reports as `stalled_s` (vllm_disagg/liveness/); None: no /live (404)."""
        self.live_expected_step_s: float | None = None
        """What GET /live reports as `expected_step_s` (the engine's expected step time)."""
        self.live_recovering_s: float | None = None
        """What GET /live reports as `recovering_s` (a model worker rebuilding a lost attention server's KV)."""
        self.health_delay_s = 0.0
        """GET /health answers after this long (a busy API server)."""
        self.token_gap_s = 0.01
        """Seconds between streamed tokens."""
        self.frozen = False
        """/health and /live never answer (a SIGSTOPped API server)."""
        self.resume = asyncio.Event()
        """Mode "paused": generation requests wait for this (a SIGCONT)."""
        self.app = web.Application()
        self.app.add_routes([
            web.post("/v1/completions", self._generate),
            web.post("/v1/chat/completions", self._generate),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/live", self._live),
            web.route("*", "/{tail:.*}", self._echo),
        ])
        self.headers: list[dict] = []
        """Headers of each generation request, in the order of `bodies`."""
        self.calls: list[tuple[str, str, dict]] = []
        """Every request the catch-all answered: (method, path with query, headers)."""
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
        while self.frozen:
            await asyncio.sleep(0.05)
        await asyncio.sleep(self.health_delay_s)
        return web.Response(status=200 if self.healthy else 503)

    async def _live(self, _req: web.Request) -> web.Response:
        while self.frozen:
            await asyncio.sleep(0.05)
        if self.live_stalled_s is None:
            return web.Response(status=404)
        return web.json_response({"live": self.live_stalled_s < 10, "stalled_s": self.live_stalled_s,
                                  "expected_step_s": self.live_expected_step_s,
                                  "recovering_s": self.live_recovering_s})

    async def _echo(self, req: web.Request) -> web.Response:
        """Any other vLLM route: answers who got it (a stored response's id on POST /v1/responses)."""
        self.calls.append((req.method, str(req.rel_url), dict(req.headers)))
        body = await req.read()
        if req.path.startswith("/v1/responses/"):
            return web.json_response({"error": {"message": "Response not found", "code": 404}}, status=404)
        out = {"served_by": self.name, "method": req.method, "path": str(req.rel_url), "body": body.decode()}
        if req.path == "/v1/responses":
            out["id"] = f"resp_{self.name}_{len(self.calls)}"
        return web.json_response(out)

    async def _models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _generate(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.bodies.append(body)
        self.headers.append(dict(req.headers))
        self.arrivals.append(time.monotonic())
        if self.mode == "error" or (self.mode == "error_once" and len(self.bodies) == 1):
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if self.mode == "stall":
            await asyncio.sleep(3600)
        if self.mode == "paused":  # a stopped engine that is continued: answers once `resume` is set
            await self.resume.wait()
        if self.mode == "reject":  # vLLM's validation error, e.g. max_tokens past the model's length
            return web.json_response({"error": {"message": "max_tokens is too large", "code": 400}}, status=400)
        context = prompt_ids(body)
        n = min(self.num_tokens, body.get("max_tokens") or self.num_tokens)
        tokens = []
        for _ in range(n):
            tokens.append(next_token(context + tokens))
        if body.get("stream"):
            return await self._stream(req, body, context, tokens)
        with_ids = bool(body.get("return_token_ids"))
        choice = {"index": 0, "text": "".join(f" t{t}" for t in tokens), "finish_reason": "length"}
        if with_ids:
            choice.update(token_ids=tokens, prompt_token_ids=context)
        answer = {"id": "x", "object": "text_completion", "choices": [choice], "served_by": self.name}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):  # as vLLM's P answers (NixlConnector)
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                            "remote_block_ids": [[1, 2]], "remote_engine_id": self.name,
                                            "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}
        return web.json_response(answer)

    async def _stream(self, req: web.Request, body: dict, context: list[int], tokens: list[int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        with_ids = bool(body.get("return_token_ids"))
        chat = "messages" in body
        die_now = self.die_after is not None and self.die_times > 0
        for i, tok in enumerate(tokens):
            last = i == len(tokens) - 1
            if chat:
                choice = {"index": 0, "delta": {"content": f" t{tok}"}, "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": f" t{tok}", "finish_reason": "length" if last else None}
            chunk = {"id": f"cmpl-{self.name}-{len(self.bodies)}", "created": len(self.bodies),
                     "model": body.get("model"), "choices": [choice], "served_by": self.name}
            if with_ids:
                choice["token_ids"] = [tok]
                if i == 0 and chat:
                    chunk["prompt_token_ids"] = context
                elif i == 0:
                    choice["prompt_token_ids"] = context
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.token_gap_s)
            if die_now and i + 1 == self.die_after:
                self.die_times -= 1
                req.transport.close()  # the process "dies": connection drops mid-stream
                return resp
            if self.mode == "die_mid_stream" and i == 0:
                req.transport.close()
                return resp
            if self.mode == "stall_mid_stream" and i == 0:
                await asyncio.sleep(3600)
        await resp.write(b"data: [DONE]\n\n")
        return resp


def prompt_ids(body: dict) -> list[int]:
    """Token ids of the prompt as the fake sees it (text: its bytes; chat: the bytes of every content)."""
    if "messages" in body:
        return list("".join(str(m.get("content")) for m in body["messages"]).encode())
    prompt = body.get("prompt")
    return list(prompt) if isinstance(prompt, list) else list(str(prompt).encode())


def next_token(context: list[int]) -> int:
    """Deterministic "greedy" next token of a context: a continuation reproduces it only if it is exact."""
    return (sum(t * (k + 1) for k, t in enumerate(context)) + len(context)) % 997
