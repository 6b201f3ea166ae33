# SPDX-License-Identifier: Apache-2.0
"""A real Ray cluster and `vllm-disagg up --backend ray` inside a loopback-only netns (test_ray*.py).

`RayTestCluster` starts the Ray nodes (`ray start`, each with its custom pool resources) and the
launcher in a fresh network namespace that has nothing but `lo`, and runs every client there too.
`destroy()` kills exactly the namespace's processes. Starting is split in two (`start()`, then
`wait_ready()`) so that a test can compute its plain-vLLM reference while the cluster comes up.

Ray's memory monitor is disabled (RAY_memory_monitor_refresh_ms=0): on a shared box it kills actors
for memory other processes use. Needs root + iproute2 and `pip install 'ray[default]'`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vllm_disagg.testing.netns import Netns, prereqs  # noqa: F401 (the Ray tests' prereqs)

GCS_PORT = 6390
ROUTER_PORT = 8000

CLIENT = r"""
import json, sys, urllib.request, urllib.error
from concurrent.futures import ThreadPoolExecutor
base, bodies = sys.argv[1], json.loads(sys.argv[2])
def post(body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            route = r.headers.get("x-disagg-route")
            if not body.get("stream"):
                return {"status": r.status, "route": route, "ids": json.loads(r.read())["choices"][0]["token_ids"]}
            ids, events = [], 0
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    ev = json.loads(line[6:])
                    events += 1
                    for ch in ev.get("choices", []):
                        ids += ch.get("token_ids") or []
            return {"status": r.status, "route": route, "ids": ids, "events": events}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode()[:500]}
    except OSError as e:
        return {"status": 0, "error": str(e)}
with ThreadPoolExecutor(len(bodies)) as pool:
    print(json.dumps(list(pool.map(post, bodies))))
"""


def up_command(up_args: list[str], state_file: Path, timeout_s: float) -> list[str]:
    """`vllm-disagg up --backend ray` (or `python -m vllm_disagg.launch.ray` if `up` has no --backend)."""
    help_out = subprocess.run([sys.executable, "-m", "vllm_disagg.cli.main", "up", "--help"],
                              capture_output=True, text=True, timeout=120).stdout
    prefix = (["-m", "vllm_disagg.cli.main", "up", "--backend", "ray"] if "--backend" in help_out
              else ["-m", "vllm_disagg.launch.ray"])
    return [sys.executable, *prefix, "--address", f"127.0.0.1:{GCS_PORT}", "--port", str(ROUTER_PORT),
            "--state-file", str(state_file), "--log-dir", str(state_file.parent / "logs"),
            "--health-timeout-s", str(timeout_s), *up_args]


class RayTestCluster:
    """Ray nodes + `up --backend ray` in one netns. `nodes`: per node, its CPUs and custom resources."""

    def __init__(self, nodes: list[tuple[int, dict[str, float]]], up_args: list[str],
                 up_timeout_s: float = 900) -> None:
        self.nodes, self.up_args, self.up_timeout_s = nodes, up_args, up_timeout_s
        self.tmp = Path(tempfile.mkdtemp(prefix="vdray-", dir="/tmp"))  # short: Ray's unix socket paths
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0",
                    "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_DISAGG_AUTH_TOKEN": uuid.uuid4().hex}
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # servers run like production: engine in its own process
        self.address = f"127.0.0.1:{GCS_PORT}"
        self.state_file = self.tmp / "state.json"
        self.ns: Netns | None = None
        self.up: subprocess.Popen | None = None
        self.state: dict = {}

    @property
    def url(self) -> str:
        return self.state["endpoint"]

    def start(self) -> RayTestCluster:
        """The Ray nodes (head first), then `up` in the background."""
        ray_cli = str(Path(sys.executable).with_name("ray"))
        self.ns = Netns()
        for i, (cpus, resources) in enumerate(self.nodes):
            where = (["--head", "--port", str(GCS_PORT), "--include-dashboard=false", "--temp-dir",
                      str(self.tmp / "ray")] if i == 0 else ["--address", self.address])
            node = self.ns.run(ray_cli, "start", *where, "--resources", json.dumps(resources),
                               "--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus), "--disable-usage-stats",
                               "--object-store-memory", str(100 << 20), env=self.env)
            assert node.returncode == 0, node.stderr[-3000:]
        with open(self.tmp / "up.log", "wb") as log:
            cmd = up_command(self.up_args, self.state_file, self.up_timeout_s)
            self.up = subprocess.Popen(self.ns.argv(*cmd), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> RayTestCluster:
        """Until `up` wrote its state file (every instance answered /health, the router serves)."""
        deadline = time.monotonic() + self.up_timeout_s
        while not self.state_file.exists():
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"up --backend ray did not come up:\n{self.log()}")
            time.sleep(1)
        self.state = json.loads(self.state_file.read_text())
        return self

    def complete(self, batch: list[list[int]], max_tokens: int, stream: bool | list[bool] = False) -> list[dict]:
        """Greedy completions of `batch`, sent at once from inside the netns (a list: stream per prompt)."""
        streams = stream if isinstance(stream, list) else [stream] * len(batch)
        bodies = [{"model": self.state["model"], "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True, "stream": s} for p, s in zip(batch, streams, strict=True)]
        out = self.ns.run(sys.executable, "-c", CLIENT, self.url, json.dumps(bodies), env=self.env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def status(self) -> dict:
        """`vllm-disagg status --address ... --json`, run in the netns."""
        out = self.ns.run(sys.executable, "-m", "vllm_disagg.cli.main", "status", "--address", self.address,
                          "--json", env=self.env, timeout=120)
        assert out.stdout.strip(), out.stderr[-3000:]
        return json.loads(out.stdout[out.stdout.index("{"):])

    def log(self) -> str:
        path = self.tmp / "up.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def destroy(self) -> None:
        """Stop `up` (it stops the actors and placement groups), then everything left in the netns."""
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            try:
                self.up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.up.kill()
        if self.ns is not None:
            self.ns.destroy()
        shutil.rmtree(self.tmp, ignore_errors=True)
