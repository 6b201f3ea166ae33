# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --backend ray`: the P/D (and attention) pools as Ray actors across a Ray cluster.

    vllm-disagg up --backend ray --address auto --prefill 2 --decode 2 --model /shared/model
    python -m vllm_disagg.launch.ray --address ray://head:10001 --prefill 1 --decode 1   # same

Each instance is a named actor (`vllm-disagg:prefill0`, ... in Ray namespace `vllm-disagg`) that runs
the real server as a process under it: `vllm serve MODEL --plugin disagg --disagg-role ROLE` or
`vllm-disagg attn-server`. Placement: one placement group per pool, one bundle per instance, each
bundle asking for the pool's custom resource (`{"prefill": 1}`, `{"decode": 1}`, `{"attention": 1}`;
start nodes with `ray start --resources '{"prefill": 4}'`), plus CPUs/GPUs and an optional
`accelerator_type`. Peers find each other through GCS: the router (in this driver) reads the
named actors' endpoints (`vllm_disagg.router.discovery.RayActorSource`), never a host list.

Lamina (`--attention K`) is wired as on the local backend (`launch.local.attach_attention`): the
servers accept the prefill instances' KV pushes (`--kv-transport` = `--transport`), and the one decode
(or mixed) model worker gets `--attention-partition`, `--pipeline` and `--[no-]send-q-early`, and
the DisaggConnector (kv_consumer; a decode instance has it anyway) so that after a restart it restores
the KV its servers kept; the per-layer exchange is tcp, since the servers may sit on other nodes.

Failures: when an actor dies, or its server exits (the actor then exits itself), Ray restarts it
(`max_restarts`) in the same bundle; the restarted server comes up on new ports and the router's
discovery swaps the old member for the new one. Meanwhile the router's own health checks have
dropped the dead instance and its requests go to the remaining pool (P serves whole requests when no
D is left); when none is left (the one model worker of `--attention K`), new requests wait for the
restarted one (`RouterConfig.admission_wait_s`) and in-flight ones are replayed on it. The server process cannot outlive its actor: `launch/reaper.py` kills its process group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_disagg.envs import VLLM_DISAGG_AUTH_TOKEN

logger = logging.getLogger("vllm_disagg.launch.ray")

NAMESPACE = "vllm-disagg"
ACTOR_PREFIX = "vllm-disagg:"
ROUTER_KEY = b"vllm-disagg:router"
"""GCS internal-KV key holding the router's URL (read by `vllm-disagg status`)."""
POOLS = ("prefill", "decode", "mixed", "attention")


# ------------------------------------------------------------------------------------- CLI flags
def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """Flags `up` needs for `--backend ray` (shared by `launch/cli.py` and this module's main)."""
    g = parser.add_argument_group("ray backend")
    g.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: processes on this host; ray: actors placed on a Ray cluster")
    g.add_argument("--address", default="auto", help="Ray cluster: auto, HOST:PORT or ray://HOST:10001")
    g.add_argument("--attention", type=int, default=0, help="Lamina attention workers (decode uses them)")
    g.add_argument("--ray-namespace", default=NAMESPACE, help="Ray namespace of the instance actors")
    g.add_argument("--router-host", default="127.0.0.1", help="interface of the router (0.0.0.0: all)")
    g.add_argument("--cpus-per-instance", type=float, default=1.0, help="Ray CPUs reserved per instance")
    g.add_argument("--gpus-per-instance", type=float, default=0.0, help="Ray GPUs reserved per instance")
    g.add_argument("--accelerator-type", default=None, help="Ray accelerator_type for P/D bundles (e.g. H100)")
    g.add_argument("--placement-strategy", default="SPREAD", choices=("PACK", "SPREAD", "STRICT_SPREAD"),
                   help="how a pool's bundles spread over nodes")
    g.add_argument("--max-restarts", type=int, default=3, help="Ray restarts a dead instance actor this often")
    g.add_argument("--attention-port", type=int, default=8300,
                   help="HTTP port of attention worker i is this + i (fixed: decode lists them)")


# ---------------------------------------------------------------------------------------- specs
@dataclass
class ActorSpec:
    """What one instance actor runs; plain data so Ray can ship it to the node."""

    role: str
    index: int
    model: str
    served_name: str | None = None
    transport: str = "tcp"
    vllm_args: list[str] = field(default_factory=list)
    kv_cache_gib: float = 1.0
    cores_per_instance: int = 1
    attention_servers: list[str] = field(default_factory=list)
    http_port: int = 0
    """0: pick a free port at every (re)start; attention workers use a fixed one."""
    kv_transport: str | None = None
    """Attention worker: accept prefill KV pushes on this transport (the prefill instances' kv.transport);
    None when the deployment has no prefill instance."""
    remote_attention: dict = field(default_factory=dict)
    """Decode/mixed model worker: `additional_config["disagg"]["remote_attention"]` besides the servers
    (partition, pipeline, send_q_early), as `up --attention K` builds it on the local backend."""
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    """Parent of the instance's log folder on its node (default: the node's temp dir)."""

    @property
    def name(self) -> str:
        return f"{ACTOR_PREFIX}{self.role}{self.index}"


def plan_actor_specs(args: argparse.Namespace, model: str) -> list[ActorSpec]:
    """One spec per instance, attention workers first (decode needs their addresses)."""
    if args.prefill is None:  # left out: one P instance (see launch.cli.resolve_prefill for local)
        args.prefill = 1
    if args.prefill and not args.decode:
        raise ValueError("--prefill needs at least one --decode instance to push to")
    mixed = args.mixed if (args.prefill or args.decode or args.mixed) else 1
    token = os.environ.get(VLLM_DISAGG_AUTH_TOKEN) or secrets.token_hex(16)
    common = dict(model=model, served_name=args.model, transport=args.transport,
                  vllm_args=list(getattr(args, "vllm_args", [])), kv_cache_gib=args.kv_cache_gib,
                  cores_per_instance=args.cores_per_instance, env={VLLM_DISAGG_AUTH_TOKEN: token},
                  log_dir=getattr(args, "log_dir", None))
    if not getattr(args, "access_log", False):
        common["vllm_args"].append("--disable-uvicorn-access-log")
    if args.attention and args.decode + mixed != 1:
        raise ValueError("--attention K serves exactly one model worker: use one --decode (or --prefill 0 "
                         f"--decode 0 for one mixed instance), got {args.decode} decode + {mixed} mixed")
    attention = {**common, "kv_cache_gib": getattr(args, "attention_kv_cache_gib", args.kv_cache_gib),
                 "kv_transport": args.transport if args.prefill else None}
    specs = [ActorSpec("attention", i, http_port=args.attention_port + i, **attention)
             for i in range(args.attention)]
    for role, num in (("prefill", args.prefill), ("decode", args.decode), ("mixed", mixed)):
        specs += [ActorSpec(role, i, **common) for i in range(num)]
    if args.attention:
        for s in specs:
            if s.role in ("decode", "mixed"):
                s.remote_attention = remote_attention_settings(args)
    return specs


REPLACEMENT_WAIT_S = 180.0
"""Head-wise: how long a model worker waits for Ray to restart a lost attention worker (same bundle,
same fixed port) before giving up; one survivor alone would not hold the scheduler's blocks."""


def remote_attention_settings(args: argparse.Namespace) -> dict:
    """The model worker's remote_attention settings from `up`'s flags (local: launch.local.attach_attention).
    The per-layer exchange is tcp here: Ray places the servers on other nodes."""
    ra = {"transport": "tcp", "partition": getattr(args, "attention_partition", "head"),
          "pipeline": getattr(args, "pipeline", 1)}
    if ra["partition"] == "head":  # request-wise goes on at once with the survivors
        ra["replacement_wait_s"] = REPLACEMENT_WAIT_S
    if getattr(args, "send_q_early", None) is not None:
        ra["send_q_early"] = args.send_q_early
    return ra


def server_command(spec: ActorSpec, host: str, http_port: int, kv_port: int | None) -> list[str]:
    """The real command of an instance: `vllm serve ... --plugin disagg` or `vllm-disagg attn-server`."""
    exe_dir = Path(sys.executable).parent
    if spec.role == "attention":
        cmd = [str(exe_dir / "vllm-disagg"), "attn-server", "--transport", "tcp", "--host", host,
               "--http-port", str(http_port), "--kv-cache-gib", str(spec.kv_cache_gib)]
        if spec.kv_transport:  # prefill instances push their KV straight into this server's blocks
            cmd += ["--kv-transport", spec.kv_transport]
        return cmd
    cmd = [str(exe_dir / "vllm"), "serve", spec.model, "--host", host, "--port", str(http_port)]
    if spec.served_name and "--served-model-name" not in spec.vllm_args:
        cmd += ["--served-model-name", spec.served_name]
    if spec.role in ("prefill", "decode"):
        cmd += ["--plugin", "disagg", "--disagg-role", spec.role, "--disagg-kv-port", str(kv_port),
                "--disagg-transport", spec.transport]
    if spec.attention_servers and spec.role in ("decode", "mixed"):
        if spec.role == "mixed":  # the model worker without P/D: the connector restores retained KV
            from vllm_disagg.launch.local import CONNECTOR

            cmd += ["--plugin", "disagg",
                    "--kv-transfer-config", json.dumps({**CONNECTOR, "kv_role": "kv_consumer"})]
        ra = spec.remote_attention or {"transport": "tcp"}
        disagg = {"remote_attention": ra}
        if ra.get("pipeline", 1) > 1:  # n=2 ping-pong = the NanoFlow nano-batch executor
            disagg["nanoflow"] = {"nano_batches": ra["pipeline"]}
        cmd += ["--disagg-attention-servers", ",".join(spec.attention_servers),
                "--additional-config", json.dumps({"disagg": disagg})]
    return cmd + list(spec.vllm_args)


# ---------------------------------------------------------------------------------------- actor
class InstanceServer:
    """Body of the instance actor: starts the server process, reports its endpoint, exits with it.

    Plain class (wrapped by `ray.remote` in `instance_actor_class`) so its logic runs without Ray."""

    def __init__(self, spec_dict: dict, host: str | None = None, exit_with_server: bool = True) -> None:
        self.spec = ActorSpec(**spec_dict)
        self.exit_with_server = exit_with_server
        self.host = host or _node_ip()
        if self.spec.log_dir:
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"vllm-disagg-{self.spec.role}{self.spec.index}-",
                                             dir=self.spec.log_dir))
        self.log_path = self.log_dir / "server.log"
        self.starts = _count_start(self.spec.name)
        self.http_port, self.kv_port = self._ports()
        self._stopping = False
        self._ready = threading.Event()
        self.proc = self._start_server()
        self._reaper_w = self._start_reaper()
        threading.Thread(target=self._watch_ready, daemon=True, name="ready").start()
        threading.Thread(target=self._exit_with_server, daemon=True, name="watch").start()

    def _ports(self) -> tuple[int, int | None]:
        needs_kv = self.spec.role in ("prefill", "decode")
        ports = free_ports(2, self.host)
        http = self.spec.http_port or ports[0]
        return http, (ports[1] if needs_kv else None)

    def _start_server(self) -> subprocess.Popen:
        from vllm_disagg.launch.local import core_slices

        cmd = server_command(self.spec, self.host, self.http_port, self.kv_port)
        ordinal = POOLS.index(self.spec.role) + self.spec.index * len(POOLS)  # P0, D0 on different cores
        cores = core_slices(ordinal + 1, self.spec.cores_per_instance)[ordinal]
        env = {**os.environ, **self.spec.env, "VLLM_HOST_IP": self.host, "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": str(max(1, int(self.spec.kv_cache_gib))),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores)}
        with open(self.log_path, "wb") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)

    def _start_reaper(self) -> int:
        from vllm_disagg.launch.reaper import start_reaper

        return start_reaper(self.proc.pid)  # kept open for the actor's lifetime; closes when it dies

    def _watch_ready(self) -> None:
        while not self._ready.is_set() and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self._ready.set()
                        return
            except OSError:
                pass
            time.sleep(0.5)

    def _exit_with_server(self) -> None:
        """The server died on its own: end the actor process so Ray restarts the whole instance."""
        rc = self.proc.wait()
        if not self._stopping and self.exit_with_server:
            logger.error("%s: server exited with %s; exiting so Ray restarts the actor", self.spec.name, rc)
            os._exit(1)

    @property
    def url(self) -> str:
        return f"http://{_host_port(self.host, self.http_port)}"

    def endpoint(self) -> dict:
        """Where this instance serves now; `up` once its server answered /health."""
        alive = self.proc.poll() is None
        return {"name": self.spec.name, "role": self.spec.role, "url": self.url,
                "kv": _host_port(self.host, self.kv_port) if self.kv_port else None,
                "node_ip": self.host, "pid": self.proc.pid, "up": alive and self._ready.is_set(),
                "alive": alive, "starts": self.starts, "log": str(self.log_path)}

    def log_tail(self, num_bytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0) -> int | None:
        """Stop the server (group); its log goes too once it exited (a crash keeps it)."""
        self._stopping = True
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rc = self.proc.wait(timeout=wait)
                shutil.rmtree(self.log_dir, ignore_errors=True)
                return rc
        return None


def free_ports(num: int, host: str) -> list[int]:
    """Ports free on `host` right now (held open together so they are distinct)."""
    socks = []
    try:
        for _ in range(num):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _host_port(host: str, port: int) -> str:
    from vllm_disagg.router.discovery import host_port

    return host_port(host, port)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _starts_key(namespace: str, name: str) -> bytes:
    return f"{namespace}/{name}:starts".encode()


def _count_start(name: str) -> int:
    """How often this instance has started (GCS internal KV survives actor restarts)."""
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError:
        return 1
    if not internal_kv._internal_kv_initialized():
        return 1
    key = _starts_key(ray.get_runtime_context().namespace, name)
    n = int(internal_kv._internal_kv_get(key) or 0) + 1
    internal_kv._internal_kv_put(key, str(n).encode(), overwrite=True)
    return n


def instance_actor_class(max_restarts: int):
    import ray

    return ray.remote(max_restarts=max_restarts, max_task_retries=0)(InstanceServer)


# ------------------------------------------------------------------------------- GCS look-ups
def instance_names(namespace: str) -> list[str]:
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"] for n in names
                  if n.get("namespace") == namespace and n["name"].startswith(ACTOR_PREFIX))


def instance_endpoints(namespace: str, timeout_s: float = 5.0) -> list[dict]:
    """Endpoint of every named instance actor GCS knows (alive or restarting; a permanently dead actor
    loses its name). One that does not answer in time or fails the call (restarting, busy) gets
    `{"name", "up": None, "error"}`: unknown, not gone."""
    import ray

    handles, out = {}, []
    for name in instance_names(namespace):
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
        except ValueError as err:  # gone between listing and lookup
            logger.debug("instance %s vanished: %s", name, err)
    refs = {h.endpoint.remote(): name for name, h in handles.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in ready:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError as err:
            out.append({"name": refs[ref], "up": None, "error": type(err).__name__})
    out += [{"name": refs[ref], "up": None, "error": "no answer"} for ref in pending]
    return sorted(out, key=lambda e: e["name"])


# ------------------------------------------------------------------------------------- cluster
class RayCluster:
    """The placement groups and instance actors of one deployment."""

    def __init__(self, specs: list[ActorSpec], args: argparse.Namespace) -> None:
        self.specs = specs
        self.args = args
        self.namespace = args.ray_namespace
        self.groups: dict[str, object] = {}
        self.actors: dict[str, object] = {}

    def bundle(self, role: str) -> dict[str, float]:
        b = {"CPU": self.args.cpus_per_instance, "mixed" if role == "mixed" else role: 1}
        if role == "mixed":  # mixed instances go on nodes of either phase: no custom resource
            b.pop("mixed")
        if self.args.gpus_per_instance and role != "attention":
            b["GPU"] = self.args.gpus_per_instance
        if self.args.accelerator_type and role != "attention":
            b[f"accelerator_type:{self.args.accelerator_type}"] = 0.001
        return b

    def reserve(self, timeout_s: float) -> None:
        """One placement group per pool, one bundle per instance; waits until all are placed."""
        import ray
        from ray.util.placement_group import placement_group

        existing = instance_names(self.namespace)
        if existing:
            raise RuntimeError(f"Ray namespace {self.namespace!r} already has instances {existing}; "
                               "stop that deployment or pass --ray-namespace")
        by_role: dict[str, list[ActorSpec]] = {}
        for spec in self.specs:
            by_role.setdefault(spec.role, []).append(spec)
        for role, specs in by_role.items():
            pg = placement_group([self.bundle(role)] * len(specs), strategy=self.args.placement_strategy,
                                 name=f"{ACTOR_PREFIX}{role}")
            self.groups[role] = pg
        for role, pg in self.groups.items():
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"placement group for {role} not ready after {timeout_s:.0f} s: does the "
                                   f"cluster have {len(by_role[role])} x {self.bundle(role)}?") from None

    def launch(self, specs: list[ActorSpec]) -> None:
        """Start the instance actors of `specs`, each in its pool's bundle (same index as in the pool)."""
        from ray.experimental import internal_kv
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = instance_actor_class(self.args.max_restarts)
        for spec in specs:
            internal_kv._internal_kv_del(_starts_key(self.namespace, spec.name))  # a new deployment: count from 1
            strategy = PlacementGroupSchedulingStrategy(self.groups[spec.role],
                                                       placement_group_bundle_index=spec.index)
            self.actors[spec.name] = cls.options(
                name=spec.name, namespace=self.namespace, num_cpus=0,
                scheduling_strategy=strategy).remote(asdict(spec))
            logger.info("started actor %s in placement group %s, bundle %d", spec.name, spec.role, spec.index)

    async def wait_up(self, timeout_s: float, names: list[str] | None = None) -> list[dict]:
        """Until every (named) instance answered /health once; fails fast if one keeps dying."""
        names = names or [s.name for s in self.specs]
        deadline = time.monotonic() + timeout_s
        while True:
            eps = {e["name"]: e for e in await asyncio.to_thread(instance_endpoints, self.namespace)}
            down = [n for n in names if not eps.get(n, {}).get("up")]
            if not down:
                return [eps[n] for n in names]
            dead = [n for n in down if n not in eps]  # no name in GCS: out of restarts
            if dead or time.monotonic() > deadline:
                why = "died for good" if dead else f"not up after {timeout_s:.0f} s"
                raise RuntimeError(f"instances {dead or down} {why}:\n{self.log_tails(dead or down)}")
            await asyncio.sleep(1.0)

    def log_tails(self, names: list[str]) -> str:
        import ray

        out = []
        for name in names:
            try:
                out.append(f"--- {name}\n" + ray.get(self.actors[name].log_tail.remote(), timeout=10))
            except Exception as err:  # dead actor: nothing to read
                out.append(f"--- {name}: no log ({type(err).__name__})")
        return "\n".join(out)

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        refs = []
        for h in self.actors.values():
            with contextlib.suppress(Exception):
                refs.append(h.stop.remote())
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for h in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        for pg in self.groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        with contextlib.suppress(Exception):
            from ray.experimental import internal_kv

            internal_kv._internal_kv_del(ROUTER_KEY)


# ------------------------------------------------------------------------------------ `up` body
def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_up(args))
    except KeyboardInterrupt:
        return 130


async def _up(args: argparse.Namespace) -> int:
    import ray

    from vllm_disagg.launch.cli import resolve_model

    specs = plan_actor_specs(args, resolve_model(args.model))
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
    from vllm_disagg.router.config import RouterConfig
    from vllm_disagg.router.discovery import MembershipSync, RayActorSource
    from vllm_disagg.router.policy import SchedulerConfig
    from vllm_disagg.router.server import Router, RouterServer

    by_role = {r: [e for e in endpoints if e["role"] == r] for r in POOLS}
    config = RouterConfig(prefill_urls=[e["url"] for e in by_role["prefill"]],
                          prefill_kv=[e["kv"] for e in by_role["prefill"]],
                          decode_urls=[e["url"] for e in by_role["decode"]],
                          mixed_urls=[e["url"] for e in by_role["mixed"]],
                          push_timeout_s=args.push_timeout_s, health_interval_s=1.0)
    router = Router(config, SchedulerConfig(args.prefill_queue_threshold, args.decode_queue_threshold))
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


# -------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """`up`'s own parser (from launch/cli.py) plus the Ray flags, for `python -m vllm_disagg.launch.ray`."""
    from vllm_disagg.launch import cli

    top = argparse.ArgumentParser(prog="python -m vllm_disagg.launch.ray")
    sub = top.add_subparsers(dest="command")
    parser = cli.add_parser(sub)
    if not any(a.dest == "backend" for a in parser._actions):
        add_ray_args(parser)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(["up", *argv])
    args.backend = "ray"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
