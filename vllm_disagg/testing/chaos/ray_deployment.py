# SPDX-License-Identifier: Apache-2.0
"""The chaos campaign's deployment on Ray: a one-node Ray cluster with the pools' resources,
`vllm-disagg up --backend ray` (instance actors that Ray restarts, on new ports), and the campaign's
routers finding the instances through GCS (`router --discovery ray`), as a Ray user runs them.

It must run inside a loopback-only network namespace (`benchmarks/chaos.py --backend ray` re-runs
itself in one, testing/netns.py): Ray binds the node's address and nothing else may be reached.
This process becomes a Ray driver to read the instances' current endpoints from GCS.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.testing.chaos import leaks
from vllm_disagg.testing.chaos.deployment import Deployment, _free_port

NAMESPACE = "vllm-disagg-chaos"


@dataclass
class RayDeployment(Deployment):
    gcs_port: int = 0
    ray_dir: Path | None = None
    """Ray's temp dir: short, because Ray's unix socket paths must fit in 107 bytes."""

    def _env(self) -> dict:
        env = {**super()._env(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0",
               "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine in its own process, as in production
        return env

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start(self, timeout_s: float = 900.0) -> None:
        if self.slow_link:
            raise ValueError("slow_link needs the local backend (up --attention-kv-advertise is local only)")
        self.shm_at_start = leaks.shm_entries()
        self._start_ray()
        cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--backend", "ray", "--address", self.address,
               "--ray-namespace", NAMESPACE, "--prefill", str(self.num_prefill), "--decode", str(self.num_decode),
               "--model", self.model, "--port", str(_free_port()), "--state-file", str(self.state_file),
               "--log-dir", str(self.workdir / "logs"), "--max-restarts", "1000",
               "--health-timeout-s", str(timeout_s)]
        if self.num_attention:
            cmd += ["--attention", str(self.num_attention)]
        self._launch_up(cmd, timeout_s)
        import ray

        ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        self._start_routers()

    def _start_ray(self) -> None:
        """One node with every pool's custom resource and a logical CPU per instance."""
        self.gcs_port = self.gcs_port or _free_port()
        self.ray_dir = Path(tempfile.mkdtemp(prefix="vdray-", dir="/tmp"))
        num = self.num_prefill + self.num_decode + self.num_attention
        resources = {"prefill": self.num_prefill, "decode": self.num_decode, "attention": self.num_attention}
        out = subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", "--port",
                              str(self.gcs_port), "--include-dashboard=false", "--temp-dir", str(self.ray_dir),
                              "--node-ip-address", "127.0.0.1", "--num-cpus", str(num), "--disable-usage-stats",
                              "--resources", json.dumps(resources), "--object-store-memory", str(100 << 20)],
                             env=self._env(), capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"ray start failed: {out.stderr[-3000:]}")

    def _router_members(self) -> list[str]:
        """From GCS: Ray restarts an instance on new ports, which a static list would miss."""
        return ["--discovery", "ray", "--ray-address", self.address, "--ray-namespace", NAMESPACE,
                "--discovery-interval-s", "1"]

    def _endpoints(self) -> list[dict]:
        import ray

        from vllm_disagg.router.ray_registry import instance_endpoints

        if not ray.is_initialized():  # up never came up: ray.* would start a cluster of its own
            return []
        return instance_endpoints(NAMESPACE)

    def instances(self) -> list[dict]:
        """The instances whose server runs now (a restarting actor has none to signal or snapshot)."""
        return [e for e in self._endpoints() if e.get("alive") and e.get("pid")]

    def unhealthy(self) -> list[str]:
        why = [f"{e['name']}: restarting ({e.get('error') or 'server not up'})" for e in self._endpoints()
               if not e.get("up")]
        return why + super().unhealthy()

    def stop(self) -> list[str]:
        left = super().stop()
        import ray

        ray.shutdown()
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], env=self._env(),
                       capture_output=True, timeout=120)
        self._keep_ray_logs()
        return left

    def _keep_ray_logs(self) -> None:
        """Ray's logs go to the work dir with the rest; its short temp dir under /tmp goes (each run left
        one behind)."""
        if self.ray_dir is None:
            return
        logs = self.ray_dir / "session_latest" / "logs"
        if logs.is_dir():
            shutil.copytree(logs, self.workdir / "ray-logs", dirs_exist_ok=True, ignore_dangling_symlinks=True)
        shutil.rmtree(self.ray_dir, ignore_errors=True)
        self.ray_dir = None

