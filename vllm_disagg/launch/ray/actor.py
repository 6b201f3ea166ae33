# SPDX-License-Identifier: Apache-2.0
"""The instance actor of a Ray deployment: starts its server process on the node, reports the
endpoint, and exits with it so that Ray restarts the whole instance (`max_restarts`).

`InstanceServer` is a plain class (`instance_actor_class` wraps it in `ray.remote`), so its logic
runs and is tested without Ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from vllm_disagg.launch.instances import core_slices
from vllm_disagg.launch.ray.specs import POOLS, ActorSpec, server_command
from vllm_disagg.launch.reaper import start_reaper
from vllm_disagg.launch.shm_sweep import ShmRecord
from vllm_disagg.router.discovery import host_port

logger = logging.getLogger("vllm_disagg.launch.ray")
SHM_RECORD_S = 10.0
"""How often a running server's /dev/shm mappings are recorded (a /proc scan)."""


class InstanceServer:
    """Body of the instance actor: starts the server process, reports its endpoint, exits with it.

    Plain class (wrapped by `ray.remote` in `instance_actor_class`) so its logic runs without Ray."""

    def __init__(self, spec_dict: dict, host: str | None = None, exit_with_server: bool = True) -> None:
        self.spec = ActorSpec(**spec_dict)
        self.exit_with_server = exit_with_server
        self.host = host or node_ip()
        if self.spec.log_dir:
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"vllm-disagg-{self.spec.role}{self.spec.index}-",
                                             dir=self.spec.log_dir))
        self.log_path = self.log_dir / "server.log"
        self.starts = count_start(self.spec.name)
        self.http_port, self.kv_port = self._ports()
        self._stopping = False
        self._ready = threading.Event()
        self.shm = ShmRecord(shm_record_path(self.spec.name))
        self.shm.sweep(self.spec.name)  # the last incarnation was killed with its server: its /dev/shm files
        self.proc = self._start_server()
        self.shm.started(self.proc.pid)
        self._reaper_w = self._start_reaper()
        threading.Thread(target=self._watch_ready, daemon=True, name="ready").start()
        threading.Thread(target=self._exit_with_server, daemon=True, name="watch").start()

    def _ports(self) -> tuple[int, int | None]:
        needs_kv = self.spec.role in ("prefill", "decode")
        ports = free_ports(2, self.host)
        http = self.spec.http_port or ports[0]
        return http, (ports[1] if needs_kv else None)

    def _start_server(self) -> subprocess.Popen:
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
        return start_reaper(self.proc.pid)  # kept open for the actor's lifetime; closes when it dies

    def _watch_ready(self) -> None:
        """Sets ready once /health answers; records the server's /dev/shm files all along (vLLM maps its
        queues while it starts), so that whoever outlives the server can remove them."""
        next_record = 0.0
        while self.proc.poll() is None:
            if time.monotonic() >= next_record:
                self.shm.record()
                next_record = time.monotonic() + (SHM_RECORD_S if self._ready.is_set() else 2.0)
            if not self._ready.is_set():
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                        if resp.status == 200:
                            self._ready.set()
                            self.shm.record()
            time.sleep(0.5)

    def _exit_with_server(self) -> None:
        """The server died on its own: end the actor process so Ray restarts the whole instance."""
        rc = self.proc.wait()
        if not self._stopping and self.exit_with_server:
            logger.error("%s: server exited with %s; exiting so Ray restarts the actor", self.spec.name, rc)
            self.shm.sweep(self.spec.name)
            os._exit(1)

    @property
    def url(self) -> str:
        return f"http://{host_port(self.host, self.http_port)}"

    def endpoint(self) -> dict:
        """Where this instance serves now; `up` once its server answered /health."""
        alive = self.proc.poll() is None
        return {"name": self.spec.name, "role": self.spec.role, "url": self.url,
                "kv": host_port(self.host, self.kv_port) if self.kv_port else None,
                "node_ip": self.host, "pid": self.proc.pid, "actor_pid": os.getpid(), "up": alive and self._ready.is_set(),
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
                self.shm.sweep(self.spec.name, wait_s=5.0)
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


def shm_record_path(name: str) -> Path:
    """Node-local, per namespace and actor name: the next incarnation on this node finds it."""
    namespace = "none"
    with contextlib.suppress(Exception):
        import ray

        if ray.is_initialized():
            namespace = ray.get_runtime_context().namespace
    return Path(tempfile.gettempdir()) / "vllm-disagg-shm" / f"{namespace}-{name}.json".replace(":", "_")


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def starts_key(namespace: str, name: str) -> bytes:
    return f"{namespace}/{name}:starts".encode()


def count_start(name: str) -> int:
    """How often this instance has started (GCS internal KV survives actor restarts)."""
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError:
        return 1
    if not internal_kv._internal_kv_initialized():
        return 1
    key = starts_key(ray.get_runtime_context().namespace, name)
    n = int(internal_kv._internal_kv_get(key) or 0) + 1
    internal_kv._internal_kv_put(key, str(n).encode(), overwrite=True)
    return n


def instance_actor_class(max_restarts: int):
    import ray

    return ray.remote(max_restarts=max_restarts, max_task_retries=0)(InstanceServer)
