# SPDX-License-Identifier: Apache-2.0
"""Router pool discovery: Endpoints parsing, the Kubernetes source over real HTTP, and membership
changes applied to a real `Router` (bookings released, gauges dropped, failed lookups harmless)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.discovery import (
    KubernetesEndpointsSource,
    Member,
    MembershipSync,
    StaticSource,
    apply_members,
    members_from_endpoints,
)
from vllm_disagg.router.server import Router


def endpoints(name: str, ready: list[str], not_ready: list[str] = (), kv: int | None = 9100) -> dict:
    ports = [{"name": "http", "port": 8000, "protocol": "TCP"}]
    if kv:
        ports.append({"name": "kv", "port": kv, "protocol": "TCP"})
    return {"kind": "Endpoints", "metadata": {"name": name},
            "subsets": [{"addresses": [{"ip": ip} for ip in ready],
                         "notReadyAddresses": [{"ip": ip} for ip in not_ready], "ports": ports}]}


def test_only_ready_addresses_become_members_with_ports_looked_up_by_name():
    eps = endpoints("vllm-disagg-prefill", ["10.0.0.7", "fd00::5"], not_ready=["10.0.0.9"])
    assert members_from_endpoints("prefill", eps) == [
        Member("prefill", "http://10.0.0.7:8000", "10.0.0.7:9100"),
        Member("prefill", "http://[fd00::5]:8000", "[fd00::5]:9100"),
    ]
    assert members_from_endpoints("decode", eps)[0] == Member("decode", "http://10.0.0.7:8000", None)


def test_prefill_endpoints_without_a_kv_port_are_skipped_not_guessed():
    assert members_from_endpoints("prefill", endpoints("p", ["10.0.0.7"], kv=None)) == []
    assert members_from_endpoints("decode", {"subsets": None}) == []


def test_the_kubernetes_source_reads_endpoints_from_the_api_with_the_bearer_token():
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        name = request.match_info["name"]
        if name == "vllm-disagg-decode":
            return web.json_response(endpoints(name, ["10.0.0.8"]))
        if name == "vllm-disagg-prefill":
            return web.json_response(endpoints(name, ["10.0.0.7"]))
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    async def scenario() -> list[Member]:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/endpoints/{name}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            src = KubernetesEndpointsSource(
                "team-a", {"prefill": "vllm-disagg-prefill", "decode": "vllm-disagg-decode", "mixed": "absent"},
                api_url=f"http://127.0.0.1:{port}", token="t0ken")
            return await src.members()
        finally:
            await runner.cleanup()

    members = asyncio.run(scenario())
    assert members == [Member("prefill", "http://10.0.0.7:8000", "10.0.0.7:9100"),
                       Member("decode", "http://10.0.0.8:8000")]
    assert ("/api/v1/namespaces/team-a/endpoints/vllm-disagg-prefill", "Bearer t0ken") in seen


def _router() -> Router:
    return Router(RouterConfig(decode_urls=["http://127.0.0.1:1"]))


def test_new_members_join_their_pools_and_gone_ones_leave_with_their_gauges():
    router = _router()
    pools = router.pools
    added, removed = apply_members(pools, [Member("prefill", "http://10.0.0.7:8000", "10.0.0.7:9100"),
                                           Member("decode", "http://10.0.0.8:8000")])
    assert sorted(added) == ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]
    assert removed == ["http://127.0.0.1:1"]
    assert {i.url: i.pool.value for i in pools.instances.values()} == {
        "http://10.0.0.7:8000": "prefill", "http://10.0.0.8:8000": "decode"}
    assert (pools.instances["http://10.0.0.7:8000"].kv_host, pools.instances["http://10.0.0.7:8000"].kv_port) == (
        "10.0.0.7", 9100)
    metrics = router.metrics.render().decode()
    assert 'instance="http://127.0.0.1:1"' not in metrics
    assert 'instance="http://10.0.0.8:8000"' in metrics
    assert apply_members(pools, [Member("prefill", "http://10.0.0.7:8000", "10.0.0.7:9100"),
                                 Member("decode", "http://10.0.0.8:8000")]) == ([], [])


def test_removing_an_instance_releases_what_was_booked_on_it():
    router = _router()
    pools = router.pools
    apply_members(pools, [Member("prefill", "http://p:8000", "p:9100"), Member("decode", "http://d1:8000"),
                          Member("decode", "http://d2:8000")])
    route = pools.route(num_prompt_tokens=100, num_decode_tokens=10)
    assert route.kind == "pd"
    gone = route.target.url
    apply_members(pools, [m for m in [Member("prefill", "http://p:8000", "p:9100"),
                                      Member("decode", "http://d1:8000"), Member("decode", "http://d2:8000")]
                          if m.url != gone])
    assert pools.scheduler.num_active_requests == 0
    assert pools.scheduler.instances["http://p:8000"].num_pending_tokens == 0
    pools.prefill_done(route.req_id)  # the proxy finishing late is harmless
    pools.done(route.req_id)
    assert pools.route(100, 10).target.url != gone


def test_a_prefill_instance_whose_kv_address_changed_is_replaced():
    router = _router()
    apply_members(router.pools, [Member("prefill", "http://p:8000", "p:9100"), Member("decode", "http://d:8000")])
    added, removed = apply_members(router.pools, [Member("prefill", "http://p:8000", "p:9200"),
                                                  Member("decode", "http://d:8000")])
    assert added == removed == ["http://p:8000"]
    assert router.pools.instances["http://p:8000"].kv_port == 9200


class _Flaky:
    name = "flaky"

    def __init__(self, answers):
        self.answers = list(answers)

    async def members(self):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_failed_lookup_keeps_the_current_pools():
    router = _router()
    source = _Flaky([[Member("decode", "http://d:8000")], RuntimeError("API server down")])
    sync = MembershipSync(router, source, interval_s=60)

    async def scenario():
        await sync.sync_once()
        before = set(router.pools.instances)
        assert await sync.sync_once() == ([], [])
        return before

    assert asyncio.run(scenario()) == set(router.pools.instances) == {"http://d:8000"}


def test_the_static_source_reports_the_flags_and_checks_their_pairing():
    src = StaticSource(["http://p:1/"], ["p:9"], ["http://d:2"], [])
    assert asyncio.run(src.members()) == [Member("prefill", "http://p:1", "p:9"), Member("decode", "http://d:2")]
    with pytest.raises(ValueError, match="prefill-kv"):
        StaticSource(["http://p:1"], [], [], [])
