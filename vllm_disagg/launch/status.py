# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg status`: the pools of a running deployment, with health and load.

    vllm-disagg status --router http://127.0.0.1:8000          # any backend (local, k8s port-forward)
    vllm-disagg status --address auto                          # Ray: router + actors from GCS
    vllm-disagg status --state-file state.json                 # `up --state-file`: + attention servers

Health and pending tokens come from the router's `/health` snapshot (its own view, the one routing
uses); running/waiting requests from each instance's vLLM `/metrics`. With Ray, each instance actor
also reports its node and how often it has (re)started. Attention servers are in no router pool: they
come from the state file of `up` (or Ray actors) and report health, sessions and queue themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp

from vllm_disagg.router.ray_registry import ROUTER_KEY, instance_endpoints

_LOAD_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_ATTN_SERIES = ("vllm:disagg_attention_sessions", "vllm:disagg_attention_queue_depth")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("status", help="show pools, health and load of a running deployment",
                              description=__doc__.splitlines()[0])
    p.add_argument("--router", default=None, help="router base URL (default: read from Ray with --address)")
    p.add_argument("--address", default=None, help="Ray cluster of an `up --backend ray` deployment")
    p.add_argument("--ray-namespace", default="vllm-disagg", help="Ray namespace of the instance actors")
    p.add_argument("--state-file", default=None,
                   help="state JSON of `vllm-disagg up --state-file` (router URL and attention servers)")
    p.add_argument("--timeout-s", type=float, default=5.0, help="per request")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if not args.router and not args.address and not args.state_file:
        print("vllm-disagg status: give --router URL, --state-file or --address (Ray)", file=sys.stderr)
        return 2
    actors: list[dict] = []
    router = args.router
    if args.state_file:
        router, actors = _from_state_file(args.state_file, router)
    if args.address:
        router_from_ray, actors = _from_ray(args.address, args.ray_namespace, args.timeout_s)
        router = router or router_from_ray
    status = asyncio.run(collect(router, actors, args.timeout_s))
    print(json.dumps(status, indent=1) if args.json else render(status), flush=True)
    return 0 if status["router"].get("healthy") else 1


def _from_ray(address: str, namespace: str, timeout_s: float) -> tuple[str | None, list[dict]]:
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    try:
        from ray.experimental import internal_kv

        url = internal_kv._internal_kv_get(ROUTER_KEY)
        return (url.decode() if url else None), instance_endpoints(namespace, timeout_s)
    finally:
        ray.shutdown()


def _from_state_file(path: str, router: str | None) -> tuple[str | None, list[dict]]:
    """Router URL and attention servers of a local `up` deployment (engines are in the router's view)."""
    with open(path) as f:
        state = json.load(f)
    attention = [{"name": i["name"], "role": "attention", "url": i["url"], "pid": i.get("pid")}
                 for i in state.get("instances", []) if i.get("role") == "attention"]
    return router or state.get("endpoint"), attention


async def collect(router: str | None, actors: list[dict], timeout_s: float = 5.0) -> dict:
    """Router view + per-instance load, merged by instance URL."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        view = await _get_json(session, f"{router.rstrip('/')}/health") if router else None
        snapshot = (view or {}).get("instances", [])
        by_url = {i["url"]: dict(i) for i in snapshot}
        for a in actors:
            if a.get("url"):
                by_url.setdefault(a["url"], {"url": a["url"], "pool": a.get("role")})
                by_url[a["url"]].update(actor=a["name"], node=a.get("node_ip"), starts=a.get("starts"),
                                        actor_up=a.get("up"), pid=a.get("pid"))
        attention = {a["url"] for a in actors if a.get("role") == "attention"}
        for url in attention:  # in no router pool: their own /health says whether they serve
            by_url[url]["healthy"] = bool(await _get_json(session, f"{url}/health"))
        loads = await asyncio.gather(*(_load(session, url, _ATTN_SERIES if url in attention else _LOAD_SERIES)
                                       for url in by_url))
    for inst, load in zip(by_url.values(), loads, strict=True):
        inst.update(load)
    pools: dict[str, list[dict]] = {}
    for inst in by_url.values():
        pools.setdefault(inst.get("pool") or "?", []).append(inst)
    unlisted = [a for a in actors if not a.get("url")]
    return {"router": {"url": router, "healthy": bool(view) and view.get("status") == "ok",
                       "status": (view or {}).get("status", "unreachable")},
            "pools": pools, "unreachable_actors": unlisted}


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with session.get(url) as resp:
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def _load(session: aiohttp.ClientSession, url: str, series: tuple[str, ...] = _LOAD_SERIES) -> dict:
    """Running/waiting requests (attention servers: sessions/queue depth) from the instance's own
    Prometheus metrics (None if unreachable)."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        text = ""
    out: dict[str, float | None] = {name.split(":")[1]: None for name in series}
    for line in text.splitlines():
        for name in series:
            if line.startswith(name + "{") or line.startswith(name + " "):
                key = name.split(":")[1]
                out[key] = (out[key] or 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def render(status: dict) -> str:
    r = status["router"]
    lines = [f"router {r['url']}: {r['status']}"]
    for pool, insts in sorted(status["pools"].items()):
        lines.append(f"{pool} ({sum(1 for i in insts if i.get('healthy'))}/{len(insts)} healthy)")
        for i in insts:
            health = {True: "healthy", False: "DOWN", None: "?"}[i.get("healthy")]
            extra = f"  actor={i['actor']} node={i['node']} starts={i['starts']}" if i.get("starts") is not None else ""
            if pool == "attention":
                lines.append(f"  {i['url']:<28} {health:<8} sessions={_num(i.get('disagg_attention_sessions'))} "
                             f"queue={_num(i.get('disagg_attention_queue_depth'))}{extra}")
                continue
            lines.append(f"  {i['url']:<28} {health:<8} pending_tokens={i.get('pending_tokens', '?')} "
                         f"running={_num(i.get('num_requests_running'))} "
                         f"waiting={_num(i.get('num_requests_waiting'))}{extra}")
    for a in status.get("unreachable_actors", []):
        lines.append(f"  actor {a['name']}: not answering ({a.get('error', '?')})")
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "?" if v is None else f"{v:g}"
