# SPDX-License-Identifier: Apache-2.0
"""Where the router learns its pools from: static flags, Kubernetes Endpoints, or Ray named actors.

A `MembershipSource` answers "which instances exist right now" as a list of `Member`s.
`MembershipSync` polls one and applies the difference to a running `Router`: a new member is added
to its pool; a member that is gone is first marked unhealthy (the scheduler releases whatever was
booked on it, so in-flight requests fail over as they would on a health-check drop), then removed.
Health checks stay the router's own business: discovery only says who exists.

More: README.md, "discovery.py".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from vllm_disagg.router.ray_registry import instance_endpoints

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Member:
    """One vLLM instance a source reports."""

    role: str
    """prefill | decode | mixed"""
    url: str
    """HTTP base URL, e.g. http://10.0.0.7:8000 (the router's instance id)."""
    kv: str | None = None
    """HOST:PORT of the KV side channel (prefill instances only)."""


class MembershipSource(Protocol):
    name: str

    async def members(self) -> list[Member]:
        """Instances that exist now; raises on a failed lookup (the sync keeps the last answer)."""
        ...


def host_port(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


# ---------------------------------------------------------------------------------------- static
class StaticSource:
    """The router's static flags as a source (nothing ever changes)."""

    name = "static"

    def __init__(self, prefill: list[str], prefill_kv: list[str], decode: list[str],
                 mixed: list[str]) -> None:
        if len(prefill) != len(prefill_kv):
            raise ValueError("give one --prefill-kv HOST:PORT per --prefill URL, in the same order")
        self._members = ([Member("prefill", u.rstrip("/"), kv) for u, kv in zip(prefill, prefill_kv)]
                         + [Member("decode", u.rstrip("/")) for u in decode]
                         + [Member("mixed", u.rstrip("/")) for u in mixed])

    async def members(self) -> list[Member]:
        return list(self._members)


# ------------------------------------------------------------------------------------ kubernetes
class KubernetesEndpointsSource:
    """Ready addresses of the pool Services' Endpoints, read from the Kubernetes API over HTTPS.

    In a pod, the API server, token and CA come from the service account (KUBERNETES_SERVICE_HOST,
    /var/run/secrets/...); `api_url`/`token`/`ca_file` override them (tests, out-of-cluster)."""

    name = "kubernetes"

    def __init__(self, namespace: str | None = None, services: dict[str, str] | None = None,
                 api_url: str | None = None, token: str | None = None, ca_file: str | None = None,
                 http_port_name: str = "http", kv_port_name: str = "kv", timeout_s: float = 5.0) -> None:
        self.namespace = namespace or _pod_namespace()
        self.services = {r: s for r, s in (services or {}).items() if s}
        bad = set(self.services) - set(ROLES)
        if bad:
            raise ValueError(f"unknown pool(s) {sorted(bad)}; pools are {ROLES}")
        if not self.services:
            raise ValueError("kubernetes discovery needs at least one pool Service")
        self.api_url = (api_url or _in_cluster_api_url()).rstrip("/")
        self._token = token
        self._ca_file = ca_file if ca_file is not None else _existing(SA_DIR / "ca.crt")
        self.http_port_name, self.kv_port_name = http_port_name, kv_port_name
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._missing: set[str] = set()

    def _headers(self) -> dict[str, str]:
        # Re-read each time: projected service-account tokens rotate.
        token = self._token or _read(SA_DIR / "token")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.api_url.startswith("https://"):
            return False
        return ssl.create_default_context(cafile=self._ca_file) if self._ca_file else True

    async def members(self) -> list[Member]:
        out: list[Member] = []
        async with aiohttp.ClientSession(timeout=self.timeout, headers=self._headers()) as session:
            for role, service in self.services.items():
                url = f"{self.api_url}/api/v1/namespaces/{self.namespace}/endpoints/{service}"
                async with session.get(url, ssl=self._ssl()) as resp:
                    if resp.status == 404:  # not created (yet): say so once, not every poll
                        if service not in self._missing:
                            logger.warning("kubernetes discovery: no Endpoints %s/%s", self.namespace, service)
                        self._missing.add(service)
                        continue
                    self._missing.discard(service)
                    if resp.status != 200:
                        raise RuntimeError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:200]}")
                    out += members_from_endpoints(role, await resp.json(), self.http_port_name,
                                                  self.kv_port_name)
        return out


def members_from_endpoints(role: str, endpoints: dict, http_port_name: str = "http",
                           kv_port_name: str = "kv") -> list[Member]:
    """Members from one v1 Endpoints object: ready addresses only, ports looked up by name."""
    out = []
    for subset in endpoints.get("subsets") or []:
        ports = {p.get("name"): p["port"] for p in subset.get("ports") or [] if "port" in p}
        if http_port_name not in ports:
            logger.warning("Endpoints %s has no port named %r; skipped",
                           endpoints.get("metadata", {}).get("name"), http_port_name)
            continue
        kv_port = ports.get(kv_port_name)
        if role == "prefill" and kv_port is None:
            logger.warning("prefill Endpoints without a %r port: P instances skipped", kv_port_name)
            continue
        for addr in subset.get("addresses") or []:  # notReadyAddresses are not members
            ip = addr["ip"]
            kv = host_port(ip, kv_port) if role == "prefill" else None
            out.append(Member(role, f"http://{host_port(ip, ports[http_port_name])}", kv))
    return out


def _pod_namespace() -> str:
    return os.environ.get("POD_NAMESPACE") or _read(SA_DIR / "namespace") or "default"


def _in_cluster_api_url() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset): pass --k8s-api-url")
    return f"https://{host_port(host, int(port))}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _existing(path: Path) -> str | None:
    return str(path) if path.exists() else None


# ------------------------------------------------------------------------------------------- ray
class RayActorSource:
    """Named instance actors of `vllm_disagg.launch.ray` in a Ray namespace (GCS is the registry).

    Needs a connected Ray driver (`ray.init(namespace=...)`); the calls block, so they run in a thread.
    An actor that is restarting or whose server is not up yet is simply not a member this round."""

    name = "ray"

    def __init__(self, namespace: str, timeout_s: float = 5.0) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s

    async def members(self) -> list[Member]:
        return await asyncio.to_thread(self._members_blocking)

    def _members_blocking(self) -> list[Member]:
        return [Member(e["role"], e["url"], e.get("kv") if e["role"] == "prefill" else None)
                for e in instance_endpoints(self.namespace, self.timeout_s)
                if e.get("up") and e["role"] in ROLES]


# ------------------------------------------------------------------------------------------ sync
class MembershipSync:
    """Keeps a `Router`'s pools equal to what a source reports (polling every `interval_s`)."""

    def __init__(self, router, source: MembershipSource, interval_s: float = 5.0) -> None:
        self.router = router
        self.source = source
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._owned: set[str] = set()

    async def start(self) -> None:
        await self.sync_once()
        self._task = asyncio.create_task(self._loop(), name="disagg-router-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sync_once()

    async def sync_once(self) -> tuple[list[str], list[str]]:
        """One lookup + apply; a failed lookup keeps the current pools (logged)."""
        try:
            members = await self.source.members()
        except Exception as err:  # API server or GCS hiccup: keep serving with what we have
            logger.warning("%s discovery failed, keeping the current pools: %s", self.source.name, err)
            return [], []
        return apply_members(self.router.pools, members, self.router.health)


def apply_members(pools, members: list[Member], health=None) -> tuple[list[str], list[str]]:
    """Make `pools` (an InstancePools) hold exactly `members`; returns (added, removed) URLs."""
    from vllm_disagg.router.policy import Pool
    from vllm_disagg.router.pools import Instance

    wanted = {m.url.rstrip("/"): m for m in members}
    removed = []
    for iid, inst in list(pools.instances.items()):
        m = wanted.get(iid)
        if m is None or m.role != inst.pool.value or (m.role == "prefill" and _kv_of(inst) != m.kv):
            _remove(pools, iid)
            removed.append(iid)
    added = []
    for url, m in wanted.items():
        if url in pools.instances:
            continue
        host, port = (m.kv.rsplit(":", 1) if m.kv else (None, None))
        inst = Instance(url, Pool(m.role), url, host.strip("[]") if host else None,
                        int(port) if port else None)
        if hasattr(pools, "add_instance"):
            pools.add_instance(inst)
        else:
            pools._add(inst)
        added.append(url)
    if added or removed:
        pools.update_gauges()
        logger.info("pool membership: +%s -%s", added, removed)
    return added, removed


def _kv_of(inst) -> str | None:
    return host_port(inst.kv_host, inst.kv_port) if inst.kv_host else None


def _remove(pools, instance_id: str) -> None:
    """Unhealthy first (releases its bookings), then forget it, gauges included."""
    if hasattr(pools, "remove_instance"):
        pools.remove_instance(instance_id)
        return
    inst = pools.instances[instance_id]
    pools.set_healthy(instance_id, False)
    del pools.instances[instance_id]
    del pools.scheduler.instances[instance_id]
    for gauge in (pools.metrics.instance_pending_tokens, pools.metrics.instance_prompt_queue_s,
                  pools.metrics.instance_healthy):
        with contextlib.suppress(KeyError):
            gauge.remove(inst.pool.value, inst.url)


# ------------------------------------------------------------------------------------------- CLI
def add_discovery_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `vllm-disagg router` that pick a membership source (default: the static flags)."""
    g = parser.add_argument_group("pool discovery")
    g.add_argument("--discovery", choices=("static", "kubernetes", "ray"), default="static",
                   help="where pool membership comes from (static: --prefill/--decode/--mixed flags)")
    g.add_argument("--discovery-interval-s", type=float, default=5.0, help="period of membership lookups")
    g.add_argument("--k8s-namespace", default=None, help="namespace of the pool Services (default: the pod's)")
    g.add_argument("--k8s-prefill-service", default="vllm-disagg-prefill", help="headless Service of P pods")
    g.add_argument("--k8s-decode-service", default="vllm-disagg-decode", help="headless Service of D pods")
    g.add_argument("--k8s-mixed-service", default="", help="headless Service of plain instances (optional)")
    g.add_argument("--k8s-api-url", default=None, help="API server URL (default: in-cluster)")
    g.add_argument("--ray-address", default="auto", help="Ray cluster to read instance actors from")
    g.add_argument("--ray-namespace", default="vllm-disagg", help="Ray namespace of the instance actors")


def source_from_args(args: argparse.Namespace) -> MembershipSource | None:
    """The dynamic source the flags ask for; None for static membership."""
    kind = getattr(args, "discovery", "static")
    if kind == "kubernetes":
        services = {"prefill": args.k8s_prefill_service, "decode": args.k8s_decode_service,
                    "mixed": args.k8s_mixed_service}
        return KubernetesEndpointsSource(args.k8s_namespace, services, api_url=args.k8s_api_url)
    if kind == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(address=args.ray_address, namespace=args.ray_namespace, log_to_driver=False)
        return RayActorSource(args.ray_namespace)
    return None


def attach_from_args(router, args: argparse.Namespace) -> MembershipSync | None:
    """Run the sync for the router's lifetime (aiohttp startup/cleanup hooks); no-op when static."""
    source = source_from_args(args)
    if source is None:
        return None
    sync = MembershipSync(router, source, args.discovery_interval_s)
    attach(router, sync)
    return sync


def attach(router, sync: MembershipSync) -> None:
    async def _start(_app) -> None:
        await sync.start()

    async def _stop(_app) -> None:
        await sync.stop()

    router.app.on_startup.append(_start)
    router.app.on_cleanup.append(_stop)
