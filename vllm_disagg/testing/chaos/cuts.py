# SPDX-License-Identifier: Apache-2.0
"""The routers' stall cuts and the slow requests of a campaign, set against the faults.

A cut of an instance that no process fault was holding up is a false cut: the hang detection took a
working instance out of routing. Stop 24 and 25 checked that by lining log times up with the fault
list by hand; this puts the check in the report (`router_cuts`, `cuts_outside_faults`). A slow
request is listed with the faults it waited through and whether, for a while, every instance that
could serve it was held up (then no router could have done better).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

_CUT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING vllm_disagg\.router\.health: dropping instance "
                  r"(\S+) \((\w+)\) from its pool: no progress for ([\d.]+) s")
_SUSPECT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING vllm_disagg\.router\.health: instance "
                      r"(\S+) \((\w+)\) is suspect: .* \(soft limit ([\d.]+) s, (\d+) requests on it\)")
PROCESS_FAULTS = ("kill", "stop", "stop_engine", "slow")
"""Faults that hold an instance's progress up; a cut while none runs is a false cut."""
KILL_AFTERMATH_S = 60.0
"""A kill holds its target, and a decode instance waiting on a killed attention server, up until the
restart is done: measured per kill (`back_after_s`, faults.py), else this long (30-60 s for a local
vLLM instance here; a Ray restart took 94 s)."""


def router_cuts(log_paths: list[Path], t0_wall: float) -> list[dict]:
    """Every stall cut in the routers' logs, in seconds since the load started (`t0_wall`, time.time())."""
    return _events(log_paths, t0_wall, _CUT, lambda m: {"stalled_s": float(m[5])})


def router_suspects(log_paths: list[Path], t0_wall: float) -> list[dict]:
    """Every instance the routers marked suspect (and moved not-started requests off), like `router_cuts`;
    `stalled_s` is the soft limit it passed."""
    return _events(log_paths, t0_wall, _SUSPECT, lambda m: {"stalled_s": float(m[5]), "num_requests": int(m[6])})


def _events(log_paths: list[Path], t0_wall: float, pattern: re.Pattern, fields) -> list[dict]:
    events = []
    for path in log_paths:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            m = pattern.match(line)
            if m is None:
                continue
            wall = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(m[2]) / 1000
            events.append({"t_s": round(wall - t0_wall, 3), "router": path.stem, "instance": m[3], "role": m[4],
                           **fields(m)})
    return sorted(events, key=lambda c: c["t_s"])


def _held(fault: dict, slack_s: float = 0.0) -> tuple[float, float]:
    """When a process fault holds its target up (a kill: until the restart is done)."""
    end = fault["t_end_s"]
    if fault["kind"] == "kill":
        end = fault["t_start_s"] + fault["back_after_s"] if "back_after_s" in fault else end + KILL_AFTERMATH_S
    return fault["t_start_s"] - slack_s, end + slack_s


def cuts_outside_faults(cuts: list[dict], faults: list[dict], slack_s: float = 2.0) -> list[dict]:
    """Cuts whose stall (`t_s - stalled_s` .. `t_s`) overlaps no process fault (± `slack_s`: the logs'
    clock and the campaign's differ by the time a log line takes)."""
    windows = [_held(f, slack_s) for f in faults if f["kind"] in PROCESS_FAULTS]
    return [c for c in cuts if not any(a <= c["t_s"] and c["t_s"] - c["stalled_s"] <= b for a, b in windows)]


def slow_requests(outcomes: list[dict], faults: list[dict], serving: list[str], bound_s: float) -> list[dict]:
    """Requests whose TTFT passed `bound_s`, each with the faults that overlap its wait and
    `no_serving_instance`: some moment of the wait when every instance in `serving` (the names that
    can answer alone: prefill, decode, mixed) was held up by a process fault."""
    slow = []
    for o in outcomes:
        if o.get("ttft_s") is None or o["ttft_s"] <= bound_s:
            continue
        lo, hi = o["t_sent_s"], o["t_sent_s"] + o["ttft_s"]
        hit = [f for f in faults if f["t_start_s"] <= hi and _held(f)[1] >= lo]
        held = {name: [_held(f) for f in hit if f["target"] == name and f["kind"] in PROCESS_FAULTS]
                for name in serving}
        moments = [lo] + [a for ws in held.values() for a, _ in ws if lo <= a <= hi]
        blocked = bool(serving) and any(all(any(a <= t <= b for a, b in held[n]) for n in serving) for t in moments)
        slow.append({"key": o.get("key"), "t_sent_s": lo, "ttft_s": round(o["ttft_s"], 3),
                     "faults": [f"{f['kind']} {f['target']}" for f in hit], "no_serving_instance": blocked})
    return slow


AFTERMATH_S = 30.0
"""A fault's aftermath (restarts, rejoins, replays) counts as during the fault for this long."""


def ttft_split(result: dict) -> None:
    """Mark each outcome `during_faults` when its life (sent .. answered) overlaps a fault or its
    aftermath, and set the P99 TTFT keys of both sets. By send time alone, a request sent 2 ms
    before a stop_engine fault counted as quiet and took the quiet P99 from 0.28 to 0.68 s (seed 2,
    stop 33: 21 quiet requests, so their P99 is their worst)."""
    windows = [(f["t_start_s"], (f.get("t_end_s") or f["t_start_s"]) + AFTERMATH_S) for f in result["faults"]]
    for o in result["outcomes"]:
        end = o["t_sent_s"] + (o.get("latency_s") or o.get("ttft_s") or 0.0)
        o["during_faults"] = any(a <= end and o["t_sent_s"] <= b for a, b in windows)
    during = [o["ttft_s"] for o in result["outcomes"] if o["during_faults"] and o.get("ttft_s") is not None]
    quiet = [o["ttft_s"] for o in result["outcomes"] if not o["during_faults"] and o.get("ttft_s") is not None]
    p99_f, p99_q = p99_of(during), p99_of(quiet)
    result["p99_ttft_during_faults_s"], result["p99_ttft_quiet_s"] = p99_f, p99_q
    result["num_quiet_requests"] = len(quiet)
    result["p99_ttft_during_faults / p99_ttft_quiet"] = round(p99_f / p99_q, 3) if p99_f and p99_q else None


def p99_of(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]
