# SPDX-License-Identifier: Apache-2.0
"""Who used which core while a benchmark phase ran (pd_calibrate.py): per thread CPU seconds and
runqueue wait of P's, D's and the harness's process trees, and each core's busy time, so a figure
measured on a shared box says how much of the box it had (`others` = other tenants)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psutil


class CpuAccount:
    """Who used which core, per phase: CPU seconds of every thread of P's and D's process trees and
    of this harness (router + client), each thread's allowed cores, and each core's busy time.

    Thread times are the kernel's (utime + stime), so contention shows as wall time without CPU time;
    `others_s` (cores' busy time not spent by P, D or the harness) is the other tenants."""

    def __init__(self, p_port: int, d_port: int) -> None:
        me = psutil.Process()
        self.groups: dict[str, list] = {"P": [], "D": [], "harness": [me]}
        for child in me.children(recursive=False):
            cmd = child.cmdline()
            port = cmd[cmd.index("--port") + 1] if "--port" in cmd else None
            key = {str(p_port): "P", str(d_port): "D"}.get(port)
            if key:
                self.groups[key] += [child, *child.children(recursive=True)]
        self.marks: list[tuple[str, dict]] = []

    def pin(self, cores: dict[str, set[int]]) -> dict[str, str]:
        """Bind every thread of each group's processes to its cores (threads and processes created
        later inherit it). vLLM's `VLLM_CPU_OMP_THREADS_BIND` binds only the worker's compute
        threads: the API server and the EngineCore (which spins on the worker's result queue, and
        steps at ~1 kHz while a request waits for its KV) float over every core, P's included."""
        for group, procs in self.groups.items():
            for proc in procs:
                try:
                    for th in proc.threads():
                        with contextlib.suppress(OSError):
                            os.sched_setaffinity(th.id, cores[group])
                except psutil.Error:
                    continue
        return {g: ",".join(map(str, sorted(c))) for g, c in cores.items()}

    def mark(self, label: str) -> None:
        self.marks.append((label, self._snapshot()))

    def _snapshot(self) -> dict:
        threads: dict[tuple, dict] = {}
        for group, procs in self.groups.items():
            for proc in procs:
                try:
                    pname = proc.name()
                    for th in proc.threads():
                        threads[(group, th.id)] = {"name": f"{pname}/{_comm(proc.pid, th.id)}",
                                                   "cpu_s": th.user_time + th.system_time,
                                                   "wait_s": _runqueue_wait_s(proc.pid, th.id),
                                                   "cores": _cores(th.id)}
                except psutil.Error:
                    continue
        cores = [{"busy_s": c.user + c.nice + c.system + c.irq + c.softirq + c.steal, "steal_s": c.steal}
                 for c in psutil.cpu_times(percpu=True)]
        return {"t": time.perf_counter(), "threads": threads, "cores": cores}

    def phases(self) -> dict:
        """Per phase (between consecutive marks): wall, per-core busy/steal, per-group CPU seconds,
        CPU seconds by allowed core set, and each group's busiest threads."""
        out = {}
        for (label, a), (_, b) in zip(self.marks, self.marks[1:]):
            groups: dict[str, dict] = {}
            for key, th in b["threads"].items():
                old = a["threads"].get(key, {"cpu_s": 0.0, "wait_s": 0.0})
                cpu, wait = th["cpu_s"] - old["cpu_s"], th["wait_s"] - old["wait_s"]
                g = groups.setdefault(key[0], {"cpu_s": 0.0, "by_cores": {}, "threads": []})
                g["cpu_s"] += cpu
                g["by_cores"][th["cores"]] = g["by_cores"].get(th["cores"], 0.0) + cpu
                g["threads"].append({"name": th["name"], "cores": th["cores"], "cpu_s": round(cpu, 3),
                                     "runqueue_wait_s": round(wait, 3)})
            for g in groups.values():
                g["threads"] = sorted(g["threads"], key=lambda x: -x["cpu_s"])[:6]
            busy = [cb["busy_s"] - ca["busy_s"] for ca, cb in zip(a["cores"], b["cores"])]
            out[label] = {"wall_s": b["t"] - a["t"], "core_busy_s": busy,
                          "core_steal_s": [cb["steal_s"] - ca["steal_s"] for ca, cb in zip(a["cores"], b["cores"])],
                          "groups": groups, "others_s": sum(busy) - sum(g["cpu_s"] for g in groups.values())}
        return out


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def _runqueue_wait_s(pid: int, tid: int) -> float:
    """Time the thread was runnable but not running (waiting for a core), from schedstat."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _cores(tid: int) -> str:
    try:
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(tid)))
    except OSError:
        return "?"


def cpu_shares(phases: dict, p_core: str | None) -> dict:
    """Cores' worth of CPU used by P, D, the harness and everything else (other tenants), per phase;
    pinned, also the share of P's core that P did not get (`not_p_on_p_core`: ~0 on a quiet box)."""
    out = {}
    for name, ph in phases.items():
        wall = ph["wall_s"] or 1.0
        out[name] = {g: round(v["cpu_s"] / wall, 3) for g, v in ph["groups"].items()}
        out[name]["others"] = round(ph["others_s"] / wall, 3)
        if p_core is not None and p_core.isdigit():
            p_cpu = ph["groups"].get("P", {}).get("cpu_s", 0.0)
            out[name]["not_p_on_p_core"] = round((ph["core_busy_s"][int(p_core)] - p_cpu) / wall, 3)
    return out


def p_main_thread(raw: dict, phase: str = "validation") -> dict | None:
    """P's busiest thread (the Worker's compute thread) in a phase: CPU, runqueue wait (runnable but
    another thread had the core) and the rest of the wall time (blocked: idle, GIL, locks)."""
    ph = raw["cpu"].get(phase)
    if not ph or not ph["groups"].get("P"):
        return None
    top = ph["groups"]["P"]["threads"][0]
    return {"wall_s": ph["wall_s"], "cpu_s": top["cpu_s"], "runqueue_wait_s": top.get("runqueue_wait_s"),
            "other_s": ph["wall_s"] - top["cpu_s"] - (top.get("runqueue_wait_s") or 0.0)}


def p_cpu_ms_per_request(raw: dict) -> float | None:
    """P's CPU per validation request (ms): an upper bound of its work, since the Worker also spins
    (vLLM's shm queue busy-loops up to 1 s after each step, yielding to anyone else on the core).
    Against a single prefill's CPU time (0.79-0.85 s for 512 tokens here) it bounds how much more
    work P did per request in (c) than in (a); wall time beyond that was waiting for the core."""
    ph = raw["cpu"].get("validation")
    return 1e3 * ph["groups"]["P"]["cpu_s"] / raw["validation"]["num_requests"] if ph else None
