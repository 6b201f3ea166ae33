# SPDX-License-Identifier: Apache-2.0
"""A whole Splitwise deployment on one host: P/D (or mixed) `vllm serve` processes plus the router.

Lifecycle: `plan_instances()` -> `LocalCluster.start()` (one process group per instance, pinned to its
own cores with VLLM_CPU_OMP_THREADS_BIND, on 127.0.0.1) -> `wait_healthy()` -> `router_config()` ->
`stop()` (SIGTERM to each group, SIGKILL after a grace period). Instances get vLLM's native flags
(`--kv-transfer-config`, `--additional-config`), so this works with or without the `--plugin` patch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from vllm_disagg.envs import VLLM_DISAGG_AUTH_TOKEN
from vllm_disagg.router.config import RouterConfig

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# A failed or stalled push makes D recompute the prompt (pd_protocol.md step 5), never fail the request.
CONNECTOR = {"kv_connector": "DisaggConnector", "kv_connector_module_path": "vllm_disagg.kv.connector",
             "kv_load_failure_policy": "recompute"}
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


class LaunchError(RuntimeError):
    """An instance did not come up; the message names it and points at its log."""


@dataclass
class InstanceSpec:
    """One vLLM server of the deployment."""

    role: str
    """prefill | decode | mixed"""
    index: int
    http_port: int
    kv_port: int | None
    cores: str
    """Value of VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "2-3"."""
    kv_extra: dict = field(default_factory=dict)
    """More `additional_config["disagg"]["kv"]` settings (e.g. layerwise_threshold_tokens)."""
    env: dict = field(default_factory=dict)
    """More environment for this instance only."""
    args: list = field(default_factory=list)
    """More `vllm serve` arguments for this instance only (after the shared ones)."""

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def kv_addr(self) -> str | None:
        return None if self.kv_port is None else f"{HOST}:{self.kv_port}"


def free_ports(num: int) -> list[int]:
    """Ports the OS reports free right now (held open together so they are distinct)."""
    socks = []
    try:
        for _ in range(num):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def core_slices(num_instances: int, cores_per_instance: int, cores: list[int] | None = None) -> list[str]:
    """Round-robin slices of this process's CPUs, one per instance (wrapping when there are too few)."""
    cpus = sorted(cores if cores is not None else os.sched_getaffinity(0))
    out = []
    for i in range(num_instances):
        start = (i * cores_per_instance) % len(cpus)
        chosen = [cpus[(start + k) % len(cpus)] for k in range(min(cores_per_instance, len(cpus)))]
        out.append(",".join(str(c) for c in sorted(set(chosen))))
    return out


def plan_instances(num_prefill: int, num_decode: int, num_mixed: int, cores_per_instance: int = 1,
                   ports: list[int] | None = None) -> list[InstanceSpec]:
    """Ports and cores for every instance; with no P/D and no mixed, one plain (mixed) instance."""
    if num_prefill and not num_decode:
        raise ValueError("--prefill needs at least one --decode instance to push to")
    if not (num_prefill or num_decode or num_mixed):
        num_mixed = 1
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode + ["mixed"] * num_mixed
    num_kv = num_prefill + num_decode
    ports = ports or free_ports(len(roles) + num_kv)
    cores = core_slices(len(roles), cores_per_instance)
    specs, kv_ports, counts = [], iter(ports[len(roles):]), dict.fromkeys(("prefill", "decode", "mixed"), 0)
    for i, role in enumerate(roles):
        kv_port = next(kv_ports) if role != "mixed" else None
        specs.append(InstanceSpec(role, counts[role], ports[i], kv_port, cores[i]))
        counts[role] += 1
    return specs


def serve_command(spec: InstanceSpec, model: str, transport: str, extra_args: list[str],
                  served_name: str | None = None, vllm_cmd: list[str] | None = None) -> list[str]:
    """The `vllm serve` command line of one instance (native flags; unknown args passed through)."""
    cmd = [*(vllm_cmd or vllm_serve_prefix()), model, "--host", HOST, "--port", str(spec.http_port)]
    if served_name and "--served-model-name" not in extra_args:
        cmd += ["--served-model-name", served_name]
    if spec.role in _KV_ROLE:
        kv_cfg = {**CONNECTOR, "kv_role": _KV_ROLE[spec.role]}
        kv = {"kv_port": spec.kv_port, "transport": transport, **spec.kv_extra}
        disagg = {"disagg": {"role": spec.role, "kv": kv}}
        cmd += ["--kv-transfer-config", json.dumps(kv_cfg), "--additional-config", json.dumps(disagg)]
    if any(a.startswith("--disagg-") for a in extra_args) and "--plugin" not in extra_args:
        cmd += ["--plugin", "disagg"]  # e.g. `up --disagg-nano-batches 2`: folded into additional_config
    return cmd + list(extra_args) + list(spec.args)


def vllm_serve_prefix() -> list[str]:
    """`<venv>/bin/vllm serve` when the CLI works; else vLLM's api_server module (no CLI shim needed)."""
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe), "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]


def instance_env(spec: InstanceSpec, kv_cache_gib: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """None for `kv_cache_gib` leaves the KV size to vLLM's own `--kv-cache-memory-bytes`."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_OMP_THREADS_BIND=spec.cores, VLLM_HOST_IP=HOST, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if kv_cache_gib is None:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.update(spec.env)
    return env


@dataclass
class LocalCluster:
    """The instance processes of one deployment (the router runs in the caller's process)."""

    specs: list[InstanceSpec]
    model: str
    transport: str = "tcp"
    extra_args: list[str] = field(default_factory=list)
    served_name: str | None = None
    kv_cache_gib: int | None = 1
    log_dir: Path = field(default_factory=lambda: Path.cwd() / "vllm-disagg-logs")
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ)
        base.setdefault(VLLM_DISAGG_AUTH_TOKEN, secrets.token_hex(16))  # one token for every peer
        for spec in self.specs:
            cmd = serve_command(spec, self.model, self.transport, self.extra_args, self.served_name)
            log = open(self.log_path(spec), "wb")  # noqa: SIM115  (owned by the child)
            logger.info("starting %s on %s (cores %s): %s", spec.name, spec.url, spec.cores, " ".join(cmd))
            self.procs[spec.name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=instance_env(spec, self.kv_cache_gib, base), start_new_session=True)
            log.close()

    def log_path(self, spec: InstanceSpec) -> Path:
        return self.log_dir / f"{spec.name}.log"

    async def wait_healthy(self, timeout_s: float = 900.0) -> None:
        """Until every instance answers GET /health with 200; fails fast when one exits."""
        deadline = time.monotonic() + timeout_s
        pending = {s.name: s for s in self.specs}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while pending:
                for name, spec in list(pending.items()):
                    self._check_alive(spec)
                    if await _healthy(session, spec.url):
                        logger.info("%s is up at %s", name, spec.url)
                        del pending[name]
                if pending and time.monotonic() > deadline:
                    raise LaunchError(f"not healthy after {timeout_s:.0f} s: {sorted(pending)}; logs in {self.log_dir}")
                if pending:
                    await asyncio.sleep(1.0)

    def _check_alive(self, spec: InstanceSpec) -> None:
        rc = self.procs[spec.name].poll()
        if rc is not None:
            tail = self.log_path(spec).read_text(errors="replace")[-3000:]
            raise LaunchError(f"{spec.name} exited with code {rc} before it was healthy; "
                              f"log {self.log_path(spec)}:\n{tail}")

    def dead_instances(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def router_config(self, **overrides) -> RouterConfig:
        by_role = {r: [s for s in self.specs if s.role == r] for r in ("prefill", "decode", "mixed")}
        return RouterConfig(prefill_urls=[s.url for s in by_role["prefill"]],
                            prefill_kv=[s.kv_addr for s in by_role["prefill"]],
                            decode_urls=[s.url for s in by_role["decode"]],
                            mixed_urls=[s.url for s in by_role["mixed"]], **overrides)

    def state(self, router_url: str | None) -> dict:
        return {"endpoint": router_url, "model": self.served_name or self.model, "log_dir": str(self.log_dir),
                "instances": [{"name": s.name, "role": s.role, "url": s.url, "kv": s.kv_addr,
                               "cores": s.cores, "pid": self.procs[s.name].pid if s.name in self.procs else None}
                              for s in self.specs]}

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after `grace_s`."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # children (EngineCore, workers) too
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("process %d did not exit after SIGKILL", proc.pid)
        deadline = time.monotonic() + 5
        while any(_group_exists(p.pid) for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(f"{url}/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
