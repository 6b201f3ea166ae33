# SPDX-License-Identifier: Apache-2.0
"""One chaos campaign: a deployment, load from a trace, a fault every 10-20 s, then leak checks.

`Deployment` runs `vllm-disagg up` (P/D, optionally a Lamina model worker with attention servers;
dead instances restarted) and `num_routers` routers of its instances on ONE port (SO_REUSEPORT),
which the clients use: losing a router costs only the streams it carried. `run_campaign` warms it
up, snapshots it idle, sends the load while the `FaultInjector` works, drains, snapshots again, and
returns the report (the keys of issue 18). Shared by `benchmarks/chaos.py` (the 10-minute soak) and
`tests/integration/test_chaos.py` (the CI-sized run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_disagg.config import KVTransferSection
from vllm_disagg.testing.chaos import leaks
from vllm_disagg.testing.chaos.clients import ChaosClients
from vllm_disagg.testing.chaos.cuts import (
    cuts_outside_faults,
    p99_of,
    router_cuts,
    router_suspects,
    slow_requests,
    ttft_split,
)
from vllm_disagg.testing.chaos.faults import KINDS, LINK_KINDS, Fault, FaultInjector, signal_group
from vllm_disagg.testing.chaos.links import KVLinks
from vllm_disagg.testing.chaos.workload import References, schedule
from vllm_disagg.testing.up import group_alive

ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--block-size", "32",
               "--seed", "0", "--max-num-seqs", "16"]


def _free_port() -> int:
    from vllm_disagg.launch.local import free_ports

    return free_ports(1)[0]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not answering 200 after {timeout_s:.0f} s")
        time.sleep(0.5)


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
        if self.push_timeout_s:
            cmd += ["--push-timeout-s", str(self.push_timeout_s)]
        links = KVLinks(self.num_attention, _free_port) if self.has_link else None
        if links is not None:
            cmd += links.up_args()
        if self.kv_verify:
            cmd += ["--disagg-kv-verify", "on"]
        log = open(self.workdir / "up.log", "wb")  # noqa: SIM115 (the child's)
        self.up = subprocess.Popen([*cmd, *self.engine_args], stdout=log, stderr=subprocess.STDOUT,
                                   env=self._env(), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.state_file.exists():
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"up did not start: {(self.workdir / 'up.log').read_text()[-3000:]}")
            time.sleep(1)
        if links is not None:
            self.links = links
            links.open(self.state()["instances"])
        self.router_port = _free_port()
        for i in range(self.num_routers):
            self.routers.append({"name": f"router-{i}", "role": "router", "url": self.url, "pid": None})
            self._spawn_router(self.routers[-1])
        _wait_http(f"{self.url}/health", 120)

    def _router_cmd(self) -> list[str]:
        state = self.state()
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
        for inst in state["instances"]:
            if inst["role"] == "prefill":
                cmd += ["--prefill", inst["url"], "--prefill-kv", inst["kv"]]
            elif inst["role"] in ("decode", "mixed"):
                cmd += ["--decode" if inst["role"] == "decode" else "--mixed", inst["url"]]
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
                try:
                    with urllib.request.urlopen(f"{inst['url']}/health", timeout=5) as resp:
                        health = json.loads(resp.read())
                except OSError:
                    continue
                kv = health.get("kv_listen_address") or health.get("kv_address")  # the receiver, not a proxy
                ports += [(f"{inst['name']}-{k}", v) for k, v in (("address", health.get("address")), ("kv_address", kv))
                          if v]
        return ports

    def http_urls(self) -> list[str]:
        return [self.url] + [i["url"] for i in self.instances() if i["role"] != "attention"]

    def unhealthy(self) -> list[str]:
        """What is not healthy (empty: all is): every instance must answer its own `/health`, the
        router must have every one in routing, and every router must run. The instances are asked
        themselves: a router restarted a moment ago still counts unpolled instances healthy."""
        why = [f"{inst['name']}: /health does not answer 200" for inst in self.instances()
               if not _answers(f"{inst['url']}/health")]
        why += [f"router pid {r['pid']} exited" for r in self.routers if r["proc"].poll() is not None]
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError) as err:
            return [*why, f"router /health: {err!r}"]
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


@dataclass
class CampaignConfig:
    duration_s: float = 600.0
    fault_every_s: tuple[float, float] = (10.0, 20.0)
    """From one fault's start to the next one's (a long SIGSTOP is followed at once)."""
    kinds: tuple[str, ...] = KINDS
    roles: tuple[str, ...] = ("prefill", "decode", "attention")
    stop_s: tuple[float, float] = (5.0, 30.0)
    rps: float = 0.5
    num_workers: int = 4
    seed: int = 0
    num_faults: int | None = None
    """Stop injecting after this many (the CI run); None: until the end of `duration_s`."""
    quiet_s: float = 30.0
    """Load without faults first: the TTFT baseline of `p99_ttft_during_faults / p99_ttft_quiet`."""
    plan: tuple[tuple[str, str], ...] | None = None
    """A fixed fault plan, (kind, role) in order (the CI run: a kill first, so its restart overlaps
    the other faults); None: drawn by `plan_faults`."""
    bad_http_s: float = 10.0
    """How long the slowloris connections of a `bad_http` fault stay open."""


QUICK_PLAN = (("corrupt_link", ""), ("kill", "decode"), ("garbage_frames", ""), ("stop_engine", "prefill"),
              ("bad_http", ""), ("stop", "prefill"), ("router_restart", "router"))
"""The CI run's seven faults of seven kinds: the byte flip first (it needs D up to push to), then the
kill, so its ~50 s restart overlaps the rest. Run with `Deployment(slow_link=True, kv_verify=True)`."""
QUICK_STALL_TIMEOUT_S = 4.0
"""Shorter than the SIGSTOPs of QUICK_PLAN (6 s), so the stall watchdog acts in the CI run."""


def quick_config(seed: int = 0) -> CampaignConfig:
    """The CI-sized run (tests/integration/test_chaos.py, `benchmarks/chaos.py --quick`): ~45 s of load."""
    return CampaignConfig(duration_s=40.0, rps=0.6, seed=seed, plan=QUICK_PLAN, quiet_s=5.0, stop_s=(6.0, 6.0),
                          fault_every_s=(3.0, 4.0), bad_http_s=3.0)


def plan_faults(cfg: CampaignConfig, roles: list[str], rng: random.Random) -> list[tuple[str, str]]:
    """(kind, role) in an order that cycles through every kind (and role) before repeating one."""
    if cfg.plan is not None:
        return list(cfg.plan)
    out: list[tuple[str, str]] = []
    role_cycle: list[str] = []
    n = cfg.num_faults or int(cfg.duration_s / cfg.fault_every_s[0]) + 1
    while len(out) < n:
        kinds = list(cfg.kinds)
        rng.shuffle(kinds)
        for kind in kinds:
            if not role_cycle:
                role_cycle = [r for r in cfg.roles if r in roles]
                rng.shuffle(role_cycle)
            role = "router" if kind == "router_restart" else ("" if kind in ("garbage_frames", "bad_http", *LINK_KINDS)
                                                              else role_cycle.pop())
            if kind == "stop_engine" and role == "attention":
                role = "decode"  # an attention server has no EngineCore
            out.append((kind, role))
    return out[:n]


def _inject(inj: FaultInjector, kind: str, role: str, cfg: CampaignConfig, rng: random.Random) -> Fault:
    if kind == "kill":
        return inj.kill(role)
    if kind == "router_restart":
        fault = inj.kill("router")
        fault.kind = "router_restart"
        return fault
    if kind in ("stop", "stop_engine"):
        return inj.stop(role, rng.uniform(*cfg.stop_s), engine_only=kind == "stop_engine")
    if kind == "slow":
        return inj.slow(role, rng.uniform(10, 20))
    if kind == "slow_link":
        return inj.slow_link(rng.uniform(10, 20))
    if kind == "corrupt_link":
        return inj.corrupt_link(rng.uniform(10, 20))
    if kind == "garbage_frames":
        return inj.garbage_frames()
    return inj.bad_http(cfg.bad_http_s)


def _inject_faults(inj: FaultInjector, cfg: CampaignConfig, roles: list[str], rng: random.Random, until: float,
                   log) -> list[Fault]:
    """The plan's faults, one after the other, each `fault_every_s` after the previous one started."""
    faults: list[Fault] = []
    last_start = time.monotonic()
    for kind, role in plan_faults(cfg, roles, rng):
        at = max(time.monotonic(), last_start + rng.uniform(*cfg.fault_every_s))
        if at >= until:
            break
        time.sleep(max(0.0, at - time.monotonic()))
        last_start = time.monotonic()
        try:
            faults.append(_inject(inj, kind, role, cfg, rng))
        except Exception as err:  # noqa: BLE001 (a fault that could not be injected is reported, not fatal)
            log(f"fault {kind} {role} failed: {err!r}")
            faults.append(Fault(kind, role, time.monotonic(), time.monotonic(), {"error": repr(err)}))
    return faults


def run_campaign(dep: Deployment, refs: References, cfg: CampaignConfig, log=print) -> dict:
    rng = random.Random(cfg.seed)
    clients = ChaosClients(dep.url, dep.state()["model"], refs.outputs, cfg.num_workers)
    _warm_up(clients, refs, cfg)
    base = leaks.snapshot(dep.instances(), dep.token)
    plan = schedule(len(refs.prompts) * 50, cfg.rps, cfg.seed)
    requests = refs.requests(plan, cfg.seed)
    t0, t0_wall = time.monotonic(), time.time()
    load_avg = [os.getloadavg()]
    until = t0 + cfg.quiet_s + cfg.duration_s
    sender = threading.Thread(target=clients.run, args=(requests, t0, until), name="chaos-sender", daemon=True)
    sender.start()
    try:
        time.sleep(cfg.quiet_s)
        if not dep.has_link:  # nothing to throttle or corrupt: those kinds would only be skipped
            cfg = dataclasses.replace(cfg, kinds=tuple(k for k in cfg.kinds if k not in LINK_KINDS))
        faults = _inject_faults(FaultInjector(dep, rng, log), cfg, dep.roles(), rng, until, log)
        sender.join(timeout=max(0.0, until - time.monotonic()) + 900)
    except BaseException:
        clients.stop()  # no new requests after a failure of the run itself
        raise
    load_avg.append(os.getloadavg())
    healthy = dep.wait_all_healthy(300)
    time.sleep(3)  # P frees pushes after its request ended; the routers' polls settle
    end, settle_s = leaks.settled_snapshot(lambda: leaks.snapshot(dep.instances(), dep.token), base,
                                           (dep.push_timeout_s or KVTransferSection.model_fields["push_timeout_s"].default) + 5.0)
    clients.close()
    result = report(clients.outcomes, faults, base, end, t0, cfg, load_avg, healthy)
    result["settle_s"] = settle_s
    result["router_cuts"] = router_cuts([dep.workdir / f"{r['name']}.log" for r in dep.routers], t0_wall)
    result["cuts_outside_faults"] = cuts_outside_faults(result["router_cuts"], result["faults"])
    result["router_suspects"] = router_suspects([dep.workdir / f"{r['name']}.log" for r in dep.routers], t0_wall)
    result["suspects_outside_faults"] = cuts_outside_faults(result["router_suspects"], result["faults"])
    explain_slow(result, [i["name"] for i in dep.instances() if i["role"] in ("prefill", "decode", "mixed")])
    return result


def explain_slow(result: dict, serving: list[str]) -> None:
    """`slow_requests`: past the goal (3 x quiet p99), with the faults each waited through; and, as a
    secondary key, the during-faults p99 without the requests sent while no instance could serve."""
    quiet = result["p99_ttft_quiet_s"]
    if not quiet:
        return
    slow = slow_requests(result["outcomes"], result["faults"], serving, 3 * quiet)
    result["slow_requests"] = slow
    blocked = {(s["key"], s["t_sent_s"]) for s in slow if s["no_serving_instance"]}
    during = [o["ttft_s"] for o in result["outcomes"] if o["during_faults"] and o["ttft_s"] is not None
              and (o["key"], o["t_sent_s"]) not in blocked]
    p99 = p99_of(during)
    result["p99_ttft_during_faults_with_a_serving_instance_s"] = p99
    result["p99_ttft_during_faults_with_a_serving_instance / p99_ttft_quiet"] = round(p99 / quiet, 3) if p99 else None


def _warm_up(clients: ChaosClients, refs: References, cfg: CampaignConfig) -> None:
    """One request of each form (so the idle snapshot sees warm pools and compiled paths)."""
    plan = [(0.0, i, form, stream, False) for i in range(2) for form in ("completions", "chat")
            for stream in (False, True)]
    clients.run(refs.requests(plan, cfg.seed), time.monotonic(), time.monotonic() + 1)
    clients.outcomes.clear()


def report(outcomes, faults: list[Fault], base: dict, end: dict, t0: float, cfg: CampaignConfig,
           load_avg: list, healthy: bool) -> dict:
    diff = leaks.compare(base, end)
    counts = {k: sum(1 for o in outcomes if o.outcome == k) for k in ("ok", "wrong", "lost", "left")}
    result = {
        "requests_total": len(outcomes), "requests_ok": counts["ok"], "requests_left_on_purpose": counts["left"],
        "requests_lost": counts["lost"], "requests_wrong": counts["wrong"],
        "kv_blocks_leaked": diff["kv_blocks_leaked"], "shm_segments_leaked": diff["shm_segments_leaked"],
        "leaks": diff["leaks"], "new_shm": diff["new_shm"],
        "max_stall_s": round(max((o.max_gap_s for o in outcomes), default=0.0), 3),
        "median_ttft_s": statistics.median([o.ttft_s for o in outcomes if o.ttft_s]) if outcomes else None,
        "num_faults": len(faults), "fault_kinds": sorted({f.kind for f in faults}),
        "faults": [f.as_dict(t0) for f in faults],
        "all_healthy_at_end": healthy,
        "retried_requests": sum(1 for o in outcomes if o.num_attempts > 1),
        "outcomes": [{**{k: v for k, v in asdict(o).items() if k != "last_token_at"},
                      "t_sent_s": round(o.t_sent - t0, 3)} for o in outcomes],
        "config": {**asdict(cfg), "fault_every_s": list(cfg.fault_every_s),
                   "plan": [list(p) for p in cfg.plan] if cfg.plan else None},
        "loadavg_before": load_avg[0], "loadavg_after": load_avg[-1],
        "snapshots": {"start": base, "end": end},
    }
    ttft_split(result)  # during_faults of each outcome and the P99 TTFT keys
    return result
