# SPDX-License-Identifier: Apache-2.0
"""A whole Splitwise deployment on one host: P/D (or mixed) `vllm serve` processes plus the router,
and optionally Lamina attention servers (`vllm-disagg attn-server`) for the decode instance.

Lifecycle: `plan_instances()` -> `LocalCluster.start()` (one process group per instance, pinned to its
own cores with VLLM_CPU_OMP_THREADS_BIND, on 127.0.0.1) -> `wait_healthy()` -> `router_config()` ->
`stop()` (SIGTERM to each group, SIGKILL after a grace period). Instances get vLLM's native flags
(`--kv-transfer-config`, `--additional-config`), so this works with or without the `--plugin` patch.
With attention servers, `start(attention_specs(...))` runs them first: the model worker connects to them
while it loads, so they must answer `/health` before it starts.

More: README.md, "local.py".
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from vllm_disagg.envs import VLLM_DISAGG_AUTH_TOKEN
from vllm_disagg.launch.instances import (  # noqa: F401 - re-exported: they lived here
    _KV_ROLE,
    CONNECTOR,
    HOST,
    AttentionPlan,
    InstanceSpec,
    LaunchError,
    _static_port_range,
    attach_attention,
    attn_server_command,
    bind_process,
    core_slices,
    free_ports,
    instance_env,
    parse_cores,
    plan_instances,
    serve_command,
    vllm_serve_prefix,
)
from vllm_disagg.launch.reaper import start_reaper
from vllm_disagg.launch.shm_sweep import ShmSweeper
from vllm_disagg.router.config import RouterConfig

logger = logging.getLogger(__name__)
_SHM_RECORD_TICKS = 10  # supervisor ticks (0.5 s) between two looks at what an instance maps in /dev/shm

@dataclass(frozen=True)
class RestartPolicy:
    """How the launcher restarts an instance that died after it was healthy."""

    max_restarts: int = 5
    """Restarts per instance over the deployment's life; past it the instance stays down."""
    backoff_s: float = 1.0
    """Delay before the first restart; it doubles with each restart of the same instance."""
    max_backoff_s: float = 30.0
    roles: tuple[str, ...] = ("prefill", "decode", "mixed")
    """Attention servers are not restarted here: their KV is gone with them (attention/recovery.py)."""

    def delay(self, num_restarts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** num_restarts)


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
    _reapers: dict[str, int] = field(default_factory=dict, repr=False)  # pipe write ends, see launch/reaper.py
    _token: str | None = field(default=None, repr=False)
    restart: RestartPolicy | None = field(default_factory=RestartPolicy)
    """None: a dead instance stays dead (the router drops it)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts so far, per instance name."""
    bind_cores: bool = True
    """Bind each instance's whole process tree to its cores, not only vLLM's compute threads: its
    API server and EngineCore (which spin-waits on its worker) otherwise float onto the other
    instances' cores. Measured with benchmarks/pd_calibrate.py --quick on 1P+1D: TTFT P90 error
    +17 % bound, +154 % unbound; D took 1.6 cores while decoding unbound."""
    on_restart: Callable[[InstanceSpec], None] | None = None
    """Called (from the supervisor thread) after an instance was started again, e.g. to rewrite the
    state file with its new pid."""
    _supervisor: threading.Thread | None = field(default=None, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watched: set[str] = field(default_factory=set, repr=False)  # healthy once: restarted when they die
    _shm: ShmSweeper = field(default_factory=ShmSweeper, repr=False)  # a killed instance's /dev/shm files

    def start(self, specs: list[InstanceSpec] | None = None) -> None:
        """Start `specs` (default: all); call again with the rest to start in stages."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self._token:
            self._token = os.environ.get(VLLM_DISAGG_AUTH_TOKEN) or secrets.token_hex(16)  # one for every peer
        for spec in self.specs if specs is None else specs:
            self._spawn(spec)

    def _spawn(self, spec: InstanceSpec) -> None:
        """Start one instance in its own process group, with a reaper; a restart appends to its log."""
        self._shm.started(spec.name)
        cmd = serve_command(spec, self.model, self.transport, self.extra_args, self.served_name)
        base = {**os.environ, VLLM_DISAGG_AUTH_TOKEN: self._token}
        log = open(self.log_path(spec), "ab" if spec.name in self.procs else "wb")  # noqa: SIM115  (the child's)
        logger.info("starting %s on %s (cores %s): %s", spec.name, spec.url, spec.cores, " ".join(cmd))
        self.procs[spec.name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=instance_env(spec, self.kv_cache_gib, base), start_new_session=True)
        log.close()
        if self.bind_cores:
            bind_process(self.procs[spec.name].pid, spec.cores)
        # a launcher killed with SIGKILL cannot stop its instances: the reaper does
        self._reapers[spec.name] = start_reaper(self.procs[spec.name].pid)

    def log_path(self, spec: InstanceSpec) -> Path:
        return self.log_dir / f"{spec.name}.log"

    async def wait_healthy(self, timeout_s: float = 900.0, specs: list[InstanceSpec] | None = None) -> None:
        """Until every instance (of `specs`) answers GET /health with 200; fails fast when one exits."""
        deadline = time.monotonic() + timeout_s
        pending = {s.name: s for s in (self.specs if specs is None else specs)}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while pending:
                for name, spec in list(pending.items()):
                    self._check_alive(spec)
                    if await _healthy(session, spec.url):
                        logger.info("%s is up at %s", name, spec.url)
                        del pending[name]
                        self._watch(spec)
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

    # --------------------------------------------------------- supervision
    def _watch(self, spec: InstanceSpec) -> None:
        """From now on, restart `spec` when it dies (if the policy covers its role)."""
        if self.restart is None or spec.role not in self.restart.roles:
            return
        with self._lock:
            self._watched.add(spec.name)
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="vllm-disagg-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self) -> None:
        """Poll the watched instances; restart the dead ones after their backoff (until stop())."""
        due: dict[str, float] = {}
        by_name = {s.name: s for s in self.specs}
        ticks = 0
        while not self._stopping.wait(0.5):
            with self._lock:
                names = sorted(self._watched)
            ticks += 1
            for name in names:
                if self.procs[name].poll() is None:
                    if ticks % _SHM_RECORD_TICKS == 1:  # what it maps in /dev/shm, removed if it is killed
                        self._shm.record(name, self.procs[name].pid)
                    continue
                num = self.restarts.get(name, 0)
                if num >= self.restart.max_restarts:
                    logger.error("%s died and was restarted %d times already: it stays down", name, num)
                    self._watched.discard(name)
                    continue
                if name not in due:
                    due[name] = time.monotonic() + self.restart.delay(num)
                    logger.warning("%s exited with code %s; restarting it in %.1f s", name,
                                   self.procs[name].returncode, self.restart.delay(num))
                elif time.monotonic() >= due[name]:
                    del due[name]
                    self._restart(by_name[name], num + 1)

    def _restart(self, spec: InstanceSpec, num: int) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            old = self.procs[spec.name]
            _signal_group(old, signal.SIGKILL)  # what is left of it (EngineCore) holds ports and memory
            deadline = time.monotonic() + 10
            while _group_exists(old.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            os.close(self._reapers.pop(spec.name))
            self._shm.sweep(spec.name)
            self.restarts[spec.name] = num
            logger.warning("restarting %s (restart %d of at most %d), same ports and flags", spec.name, num,
                           self.restart.max_restarts)
            self._spawn(spec)
        if self.on_restart is not None:
            try:
                self.on_restart(spec)
            except Exception:  # a hook must not stop the supervision
                logger.exception("on_restart hook failed for %s", spec.name)

    def dead_instances(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def router_config(self, **overrides) -> RouterConfig:
        by_role = {r: [s for s in self.specs if s.role == r] for r in ("prefill", "decode", "mixed")}
        # attention servers are not in a pool: only their model worker talks to them
        return RouterConfig(prefill_urls=[s.url for s in by_role["prefill"]],
                            prefill_kv=[s.kv_addr for s in by_role["prefill"]],
                            decode_urls=[s.url for s in by_role["decode"]],
                            mixed_urls=[s.url for s in by_role["mixed"]], auth_token=self._token, **overrides)

    def state(self, router_url: str | None) -> dict:
        spans = self.log_dir / "spans.jsonl"
        return {"endpoint": router_url, "model": self.served_name or self.model, "log_dir": str(self.log_dir),
                "trace_file": str(spans) if spans.exists() else None,
                "instances": [{"name": s.name, "role": s.role, "url": s.url, "kv": s.kv_addr,
                               "cores": s.cores, "pid": self.procs[s.name].pid if s.name in self.procs else None}
                              for s in self.specs]}

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after `grace_s`."""
        self._stopping.set()  # no restart from here on
        if self._supervisor is not None:
            self._supervisor.join(timeout=15)
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
        for fd in self._reapers.values():
            os.close(fd)  # the groups are gone: let their reapers exit
        self._reapers.clear()
        for name in self.procs:
            self._shm.sweep(name)


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
