# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --backend ray`: reserve the pools, start the actors (attention workers first),
run the router in this driver with Ray discovery, and tear it all down on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path

from vllm_disagg.launch.ray.cluster import RayCluster
from vllm_disagg.launch.ray.specs import POOLS, plan_actor_specs
from vllm_disagg.models import launch_model
from vllm_disagg.router.cli import scheduler_config_from_args
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.discovery import MembershipSync, RayActorSource
from vllm_disagg.router.ray_registry import ROUTER_KEY
from vllm_disagg.router.server import Router, RouterServer


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_up(args))
    except KeyboardInterrupt:
        return 130


async def _up(args: argparse.Namespace) -> int:
    import ray

    try:
        specs = plan_actor_specs(args, launch_model(args.model))
    except ValueError as err:  # e.g. attention_sizing.SizingError: one line naming the flags
        print(f"vllm-disagg up: {err}", flush=True)
        return 2
    ray.init(address=args.address, namespace=args.ray_namespace, log_to_driver=False)
    cluster = RayCluster(specs, args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = sync = None
    try:
        cluster.reserve(args.health_timeout_s)
        att = [s for s in specs if s.role == "attention"]
        if att:  # attention first: decode instances are started with their (fixed) addresses
            cluster.launch(att)
            eps = await cluster.wait_up(args.health_timeout_s, [s.name for s in att])
            servers = [e["url"].removeprefix("http://") for e in eps]
            for s in specs:
                s.attention_servers = servers if s.role in ("decode", "mixed") else []
        cluster.launch([s for s in specs if s.role != "attention"])
        print(f"vllm-disagg up (ray): {len(specs)} instance actor(s) in namespace {args.ray_namespace!r}",
              flush=True)
        endpoints = await cluster.wait_up(args.health_timeout_s)
        server, sync = await _start_router(args, endpoints)
        _announce(args, server.url, endpoints)
        await _serve(stop)
        return 0
    except (RuntimeError, ValueError) as err:
        print(f"vllm-disagg up: {err}", flush=True)
        return 1
    finally:
        if sync is not None:
            await sync.stop()
        if server is not None:
            await server.stop()
        await asyncio.to_thread(cluster.stop)
        with contextlib.suppress(Exception):
            ray.shutdown()
        print("vllm-disagg up: stopped", flush=True)


async def _start_router(args: argparse.Namespace, endpoints: list[dict]):
    by_role = {r: [e for e in endpoints if e["role"] == r] for r in POOLS}
    config = RouterConfig(prefill_urls=[e["url"] for e in by_role["prefill"]],
                          prefill_kv=[e["kv"] for e in by_role["prefill"]],
                          decode_urls=[e["url"] for e in by_role["decode"]],
                          mixed_urls=[e["url"] for e in by_role["mixed"]],
                          push_timeout_s=args.push_timeout_s, health_interval_s=1.0)
    router = Router(config, scheduler_config_from_args(args))
    server = RouterServer(router, args.router_host, args.port)
    await server.start()
    sync = MembershipSync(router, RayActorSource(args.ray_namespace), interval_s=2.0)
    await sync.start()
    _publish_router(server.url)
    return server, sync


def _publish_router(url: str) -> None:
    with contextlib.suppress(Exception):
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(ROUTER_KEY, url.encode(), overwrite=True)


def _announce(args: argparse.Namespace, url: str, endpoints: list[dict]) -> None:
    state = {"endpoint": url, "model": args.model, "backend": "ray", "namespace": args.ray_namespace,
             "instances": endpoints}
    if args.state_file:
        Path(args.state_file).write_text(json.dumps(state, indent=1))
    for e in endpoints:
        print(f"  {e['name']:<22} {e['url']}  kv={e['kv']}  node={e['node_ip']}", flush=True)
    print(f"vllm-disagg up: ready. OpenAI endpoint: {url}/v1  (Ctrl-C stops)", flush=True)


async def _serve(stop: asyncio.Event) -> None:
    await stop.wait()
