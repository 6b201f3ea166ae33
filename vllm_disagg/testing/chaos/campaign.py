# SPDX-License-Identifier: Apache-2.0
"""One chaos campaign: a deployment, load from a trace, a fault every 10-20 s, then leak checks.

`run_campaign` takes a started `Deployment` (deployment.py), warms it
up, snapshots it idle, sends the load while the `FaultInjector` works, drains, snapshots again, and
returns the report (the keys of issue 18). Shared by `benchmarks/chaos.py` (the 10-minute soak) and
`tests/integration/test_chaos.py` (the CI-sized run).
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass

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
from vllm_disagg.testing.chaos.deployment import Deployment
from vllm_disagg.testing.chaos.faults import KINDS, LINK_KINDS, Fault, FaultInjector
from vllm_disagg.testing.chaos.workload import References, schedule


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
    num_planned = sum(1 for req in requests if req.arrival_s < cfg.quiet_s + cfg.duration_s)
    sender_errors: list[str] = []
    sender = threading.Thread(target=_send, args=(clients, requests, t0, until, sender_errors), name="chaos-sender",
                              daemon=True)
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
    result.update(load_check(num_planned, len(clients.outcomes), sender.is_alive(), sender_errors))
    result["router_cuts"] = router_cuts([dep.workdir / f"{r['name']}.log" for r in dep.routers], t0_wall)
    result["cuts_outside_faults"] = cuts_outside_faults(result["router_cuts"], result["faults"])
    result["router_suspects"] = router_suspects([dep.workdir / f"{r['name']}.log" for r in dep.routers], t0_wall)
    result["suspects_outside_faults"] = cuts_outside_faults(result["router_suspects"], result["faults"])
    explain_slow(result, [i["name"] for i in dep.instances() if i["role"] in ("prefill", "decode", "mixed")])
    return result


def _send(clients: ChaosClients, requests, t0: float, until: float, errors: list[str]) -> None:
    """The sender thread's body: an exception is kept for the report (a dead sender once ended two soaks
    early with nothing said; see `load_check`)."""
    try:
        clients.run(requests, t0, until)
    except BaseException as err:  # noqa: BLE001 (reported, and the run is marked incomplete)
        errors.append(f"{type(err).__name__}: {err}")
        raise


def load_check(num_planned: int, num_sent: int, sender_alive: bool, errors: list[str]) -> dict:
    """Whether the whole planned load was sent and answered: a soak whose load stopped early must not
    read as a clean run (its figures cover only part of the faults)."""
    return {"requests_planned": num_planned, "load_complete": num_sent == num_planned and not sender_alive
            and not errors, "sender_errors": errors, "sender_still_running": sender_alive}


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
