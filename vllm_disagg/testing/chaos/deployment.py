# SPDX-License-Identifier: Apache-2.0
"""The deployment a chaos campaign runs against: `vllm-disagg up` (P/D, optionally a Lamina model
worker with attention servers; dead instances restarted) and `num_routers` routers of its instances
on ONE port (SO_REUSEPORT), which the clients use: losing a router costs only the streams it carried.
It also answers the campaign's questions about the deployment: its roles, its binary ports (for
garbage frames), its HTTP URLs (for bad bodies), who is unhealthy, and what is left after `stop`.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_disagg.attention import queries
from vllm_disagg.errors import DisaggError
from vllm_disagg.testing.chaos import leaks
from vllm_disagg.testing.chaos.faults import signal_group
from vllm_disagg.testing.chaos.links import KVLinks
from vllm_disagg.testing.http import answers, health, wait_http
from vllm_disagg.testing.up import group_alive

ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32",
               "--seed", "0", "--max-num-seqs", "16"]


def _free_port() -> int:
    from vllm_disagg.launch.local import free_ports

    return free_ports(1)[0]


@dataclass
class Deployment:
    workdir: Path
    model: str
    num_attention: int = 0
    num_routers: int = 2
    num_prefill: int = 1
    num_decode: int = 1
    """Instances per role: with 2 of each a fault leaves a live one to serve (issue 18's availability)."""
    stall_timeout_s: float = 10.0
    stall_factor: float | None = None
    """The routers' `--stall-factor` (adaptive hang detection); None: the router's default (5); 0: off,
    the fixed stall_timeout_s only."""
    stall_min_s: float | None = None
    """The routers' `--stall-min-s` (the adaptive limit's floor); None: the router's default."""
    stall_release_s: float | None = None
    """The routers' `--stall-release-s` (the soft limit's floor); None: the router's default."""
    engine_args: list[str] = field(default_factory=lambda: list(ENGINE_ARGS))
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    up: subprocess.Popen | None = None
    routers: list[dict] = field(default_factory=list)
    router_port: int = 0
    shm_at_start: set[str] = field(default_factory=set)
    """/dev/shm before `up` started: after stop, anything new is left over (leaks.left_after_stop)."""
    slow_link: bool = False
    """The KV receivers advertise proxies in front of themselves (links.py: the decode instance's, or with
    attention servers each server's), which `slow_link` throttles and `corrupt_link` damages."""
    links: KVLinks | None = None
    kv_verify: bool = False
    """`--disagg-kv-verify on` on every instance: the `corrupt_link` fault needs it (and `slow_link`)."""
    push_timeout_s: float | None = None
    """`up --push-timeout-s` (None: the plugin's default)."""
    recompute_slow_pushes: bool = True
    """False: `--disagg-recompute-slow-pushes off` on every instance (a push on a slow link waits to land)."""

    @property
    def has_link(self) -> bool:
        """Proxied KV links exist into a single decode instance (every decode instance would advertise
        the same proxy) or, with attention servers, into each server."""
        return self.slow_link and (self.num_decode == 1 or bool(self.num_attention))

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _env(self) -> dict:
        return {**os.environ, "VLLM_DISAGG_AUTH_TOKEN": self.token,
                "VLLM_DISAGG_STALL_TIMEOUT_S": str(self.stall_timeout_s)}

    def start(self, timeout_s: float = 900.0) -> None:
        self.shm_at_start = leaks.shm_entries()
        cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--prefill", str(self.num_prefill),
               "--decode", str(self.num_decode),
               "--model", self.model, "--port", "0", "--state-file", str(self.state_file),
               "--log-dir", str(self.workdir / "logs"), "--restart-limit", "1000",
               "--stall-timeout-s", str(self.stall_timeout_s)]
        if self.num_attention:
            cmd += ["--attention", str(self.num_attention), "--restart-attention", "--attention-transport", "tcp"]
        links = KVLinks(self.num_attention, _free_port) if self.has_link else None
        if links is not None:
            cmd += links.up_args()
        self._launch_up(cmd, timeout_s)
        if links is not None:
            self.links = links
            links.open(self.state()["instances"])
        self._start_routers()

    def _launch_up(self, cmd: list[str], timeout_s: float) -> None:
        """Start `up` (`cmd` plus the flags every backend shares and the engine arguments), logging to
        up.log, and wait for its state file."""
        if self.push_timeout_s:
            cmd = [*cmd, "--push-timeout-s", str(self.push_timeout_s)]
        if self.kv_verify:
            cmd = [*cmd, "--disagg-kv-verify", "on"]
        if not self.recompute_slow_pushes:
            cmd = [*cmd, "--disagg-recompute-slow-pushes", "off"]
        log = open(self.workdir / "up.log", "wb")  # noqa: SIM115 (the child's)
        self.up = subprocess.Popen([*cmd, *self.engine_args], stdout=log, stderr=subprocess.STDOUT,
                                   env=self._env(), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"up did not start: {(self.workdir / 'up.log').read_text()[-3000:]}")
            time.sleep(1)

    def _start_routers(self) -> None:
        self.router_port = _free_port()
        for i in range(self.num_routers):
            self.routers.append({"name": f"router-{i}", "role": "router", "url": self.url, "pid": None})
            self._spawn_router(self.routers[-1])
        wait_http(f"{self.url}/health", 120)

    def _router_cmd(self) -> list[str]:
        return self._router_flags() + self._router_members()

    def _router_members(self) -> list[str]:
        """The instances, from `up`'s state file (its instances restart on the same addresses)."""
        cmd = []
        for inst in self.state()["instances"]:
            if inst["role"] == "prefill":
                cmd += ["--prefill", inst["url"], "--prefill-kv", inst["kv"]]
            elif inst["role"] in ("decode", "mixed"):
                cmd += ["--decode" if inst["role"] == "decode" else "--mixed", inst["url"]]
        return cmd

    def _router_flags(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "router", "--port", str(self.router_port),
               "--reuse-port", "--stall-timeout-s", str(self.stall_timeout_s), "--health-interval-s", "1"]
        if self.stall_factor is not None:
            cmd += ["--stall-factor", str(self.stall_factor)]
        if self.stall_min_s is not None:
            cmd += ["--stall-min-s", str(self.stall_min_s)]
        if self.stall_release_s is not None:
            cmd += ["--stall-release-s", str(self.stall_release_s)]
        if self.push_timeout_s:
            cmd += ["--push-timeout-s", str(self.push_timeout_s)]  # the routers hand it to D per request
        return cmd

    def _spawn_router(self, router: dict) -> None:
        log = open(self.workdir / f"{router['name']}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(self._router_cmd(), stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                start_new_session=True)
        router["pid"], router["proc"] = proc.pid, proc

    def kill_router(self, router: dict) -> None:
        signal_group(router["pid"], signal.SIGKILL)
        router["proc"].wait(10)
        self._spawn_router(router)

    def restart_attention(self, inst: dict) -> None:
        """`up --restart-attention` restarts it; nothing to do here."""

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def instances(self) -> list[dict]:
        return self.state()["instances"]

    def pick(self, role: str, rng: random.Random) -> dict:
        pool = self.routers if role == "router" else [i for i in self.instances() if i["role"] == role]
        return rng.choice(pool)

    def roles(self) -> list[str]:
        return sorted({i["role"] for i in self.instances()})

    def binary_ports(self) -> list[tuple[str, str]]:
        """Every KV side channel / receiver and attention listener (name, HOST:PORT). A decode model
        worker with attention servers binds no KV port (its KV lands on the servers' kv_address)."""
        ports = []
        for inst in self.instances():
            if inst.get("kv") and not (inst["role"] == "decode" and self.num_attention):
                ports.append((f"{inst['name']}-kv", inst["kv"]))
            if inst["role"] == "attention":
                body = health(inst["url"])
                if body is None:
                    continue
                ports += [(f"{inst['name']}-{k}", v) for k, v in (("address", body.get("address")),
                                                                  ("kv_address", _receiver(inst["url"]))) if v]
        return ports

    def http_urls(self) -> list[str]:
        return [self.url] + [i["url"] for i in self.instances() if i["role"] != "attention"]

    def unhealthy(self) -> list[str]:
        """What is not healthy (empty: all is): every instance must answer its own `/health`, the
        router must have every one in routing, and every router must run. The instances are asked
        themselves: a router restarted a moment ago still counts unpolled instances healthy."""
        why = [f"{inst['name']}: /health does not answer 200" for inst in self.instances()
               if not answers(f"{inst['url']}/health")]
        why += [f"router pid {r['pid']} exited" for r in self.routers if r["proc"].poll() is not None]
        body = health(self.url)
        if body is None:
            return [*why, "router /health does not answer 200"]
        return why + [f"router: {i.get('url', i)} not in routing" for i in body["instances"] if not i["healthy"]]

    def wait_all_healthy(self, timeout_s: float, num_in_row: int = 3, log=print) -> bool:
        """Healthy `num_in_row` times in a row, 1 s apart; says what is not, every 30 s."""
        deadline = time.monotonic() + timeout_s
        good, next_log = 0, time.monotonic() + 30
        while time.monotonic() < deadline:
            why = self.unhealthy()
            good = 0 if why else good + 1
            if good >= num_in_row:
                return True
            if why and time.monotonic() >= next_log:
                log(f"waiting for the deployment to be healthy: {why}")
                next_log += 30
            time.sleep(1)
        return False

    def stop(self) -> list[str]:
        """Stop everything; returns the process groups that outlived it (leaked children)."""
        for r in self.routers:
            signal_group(r["pid"], signal.SIGTERM)
        pids = [i["pid"] for i in self.instances()] if self.state_file.exists() else []
        if self.up is not None and self.up.poll() is None:
            os.kill(self.up.pid, signal.SIGTERM)
            try:
                self.up.wait(90)
            except subprocess.TimeoutExpired:
                signal_group(self.up.pid, signal.SIGKILL)
        for r in self.routers:
            try:
                r["proc"].wait(10)
            except subprocess.TimeoutExpired:
                signal_group(r["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 15
        alive = pids + [r["pid"] for r in self.routers]
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if group_alive(p)]
            time.sleep(0.2)
        for p in alive:
            signal_group(p, signal.SIGKILL)
        if self.links is not None:
            self.links.close()
        return [str(p) for p in alive]


def _receiver(url: str) -> str | None:
    """An attention server's KV receiver (not the proxy it may advertise), or None when it has none."""
    try:
        return queries.kv_listen_address(url.removeprefix("http://"))
    except DisaggError:
        return None
