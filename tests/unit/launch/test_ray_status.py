# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg status` against a real router (aiohttp, static pools) and a real instance /metrics."""

from __future__ import annotations

import asyncio

from aiohttp import web

from vllm_disagg.launch.status import collect, render
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.server import Router, RouterServer

INSTANCE_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
"""


async def _scenario() -> dict:
    """A decode 'instance' that only serves /health and /metrics (what status and the router read)."""
    inst = web.Application()
    inst.router.add_get("/health", lambda _r: web.Response(text="ok"))
    inst.router.add_get("/metrics", lambda _r: web.Response(text=INSTANCE_METRICS))
    inst_runner = web.AppRunner(inst)
    await inst_runner.setup()
    await web.TCPSite(inst_runner, "127.0.0.1", 0).start()
    inst_url = f"http://127.0.0.1:{inst_runner.addresses[0][1]}"
    router = RouterServer(Router(RouterConfig(decode_urls=[inst_url], mixed_urls=["http://127.0.0.1:9"])),
                          "127.0.0.1", 0)
    await router.start()
    try:
        await router.router.health.poll_once()
        await router.router.health.poll_once()  # two failed polls drop the dead mixed instance
        actors = [{"name": "vllm-disagg:decode0", "role": "decode", "url": inst_url, "node_ip": "127.0.0.1",
                   "starts": 2, "up": True, "pid": 1},
                  {"name": "vllm-disagg:prefill0", "up": None, "error": "no answer"}]
        return await collect(router.url, actors, timeout_s=5), inst_url
    finally:
        await router.stop()
        await inst_runner.cleanup()


def test_status_merges_the_router_view_instance_load_and_actor_info():
    status, inst_url = asyncio.run(_scenario())
    assert status["router"]["healthy"] is False  # not ready: the mixed pool never had a healthy member
    (dec,) = status["pools"]["decode"]
    assert dec["url"] == inst_url and dec["healthy"] is True
    assert (dec["num_requests_running"], dec["num_requests_waiting"]) == (3.0, 1.0)
    assert (dec["actor"], dec["starts"]) == ("vllm-disagg:decode0", 2)
    (mixed,) = status["pools"]["mixed"]
    assert mixed["healthy"] is False and mixed["num_requests_running"] is None
    text = render(status)
    assert "decode (1/1 healthy)" in text and "mixed (0/1 healthy)" in text
    assert "actor vllm-disagg:prefill0: not answering (no answer)" in text


def test_status_says_unreachable_when_there_is_no_router():
    status = asyncio.run(collect("http://127.0.0.1:9", [], timeout_s=2))
    assert status["router"] == {"url": "http://127.0.0.1:9", "healthy": False, "status": "unreachable"}
    assert render(status).startswith("router http://127.0.0.1:9: unreachable")
