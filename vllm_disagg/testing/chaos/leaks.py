# SPDX-License-Identifier: Apache-2.0
"""End-of-run leak checks of the chaos campaign, on every instance and attention server.

`snapshot` is taken once the deployment is warm and idle, and again after the run has drained: KV blocks
in use (vLLM's `vllm:kv_cache_usage_perc`: free blocks equal the start when it is back to 0), requests
running or waiting, attention sessions and queues, retained KV past its TTL, and per process group the
processes, threads and sockets; plus the `/dev/shm` entries of the whole box and which of them a live
process maps. `compare` lists what is left over: a /dev/shm entry is leaked when it is new and no live
process maps it (a restarted instance's own files are new names, not leaks). Python's semaphores
(`sem.mp-*`) are unmapped even while their instance lives (its resource tracker unlinks them at exit),
so `left_after_stop` checks them, and everything else, once the deployment stopped. A restarted instance
is compared with the same role's first snapshot (a new process of the same command).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

from vllm_disagg.launch.shm_sweep import SEMAPHORE_PREFIX, mapped_by_any_process

_SERVE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
_ATTN_METRICS = ("vllm:disagg_attention_sessions", "vllm:disagg_attention_queue_depth")


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


def metrics(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of each named series over its labels; plus `num_gpu_blocks` (a label of vLLM's
    `vllm:cache_config_info`) when the instance exports it, to turn usage back into blocks."""
    out = dict.fromkeys(names, 0.0)
    for line in _get(f"{url}/metrics").decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out and not line.startswith("#"):
            out[name] += float(line.rsplit(" ", 1)[-1])
        elif name == "vllm:cache_config_info" and 'num_gpu_blocks="' in line:
            value = line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0]
            if value.isdigit():
                out["num_gpu_blocks"] = float(value)
    return out


def blocks_over(snap: dict, base: dict | None) -> int:
    """KV blocks in use now beyond the start (usage is a fraction of `num_gpu_blocks`); an instance
    that does not say its block count counts as one block when its usage grew."""
    grew = snap.get("vllm:kv_cache_usage_perc", 0.0) - (base or {}).get("vllm:kv_cache_usage_perc", 0.0)
    if grew <= 1e-9:
        return 0
    return max(1, round(grew * snap["num_gpu_blocks"])) if snap.get("num_gpu_blocks") else 1


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def group_pids(pgid: int) -> list[int]:
    """Every live process of the group led by `pgid` (its tree, as the launcher starts each in its own)."""
    seen, todo = [], [pgid]
    while todo:
        pid = todo.pop()
        if pid in seen or not os.path.exists(f"/proc/{pid}"):
            continue
        seen.append(pid)
        todo += children(pid)
    return seen


def process_counts(pgid: int) -> dict:
    procs = group_pids(pgid)
    threads = sockets = 0
    names: dict[str, int] = {}
    for pid in procs:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                threads += 1
                try:
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        name = f.read().strip().rstrip("0123456789_-")
                    names[name] = names.get(name, 0) + 1
                except OSError:
                    pass
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                        sockets += 1
                except OSError:
                    pass
        except OSError:
            continue
    return {"processes": len(procs), "threads": threads, "sockets": sockets, "thread_names": names}


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def retained_past_ttl(url: str, token: str) -> int:
    """Retained blocks an attention server still lists after their TTL (`ttl_s` is the soonest expiry)."""
    req = urllib.request.Request(f"{url}/kv/retained", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = json.loads(resp.read())
    return len(body["keys"]) if body["keys"] and body["ttl_s"] < 0 else 0


def snapshot(instances: list[dict], token: str | None = None) -> dict:
    """Per instance name: its role, metrics and process counts; plus `/dev/shm` and what is mapped of it."""
    entries = shm_entries()
    out = {"instances": {}, "shm": sorted(entries), "shm_mapped": sorted(mapped_by_any_process(entries))}
    for inst in instances:
        entry = {"role": inst["role"], "pid": inst["pid"], **process_counts(inst["pid"])}
        try:
            if inst["role"] == "attention":
                entry.update(metrics(inst["url"], _ATTN_METRICS))
                if token:
                    entry["retained_past_ttl"] = retained_past_ttl(inst["url"], token)
            else:
                entry.update(metrics(inst["url"], _SERVE_METRICS))
        except OSError as err:
            entry["error"] = repr(err)
        out["instances"][inst["name"]] = entry
    return out


def compare(before: dict, after: dict, thread_slack: int = 2) -> dict:
    """What the run left behind. KV blocks, requests, sessions, processes, sockets and shm must match
    exactly; threads may differ by `thread_slack` per group (pools that grow on first use)."""
    leaks: dict[str, list[str]] = {}
    kv_blocks_leaked = 0
    first_of_role = {}
    for snap in before["instances"].values():
        first_of_role.setdefault(snap["role"], snap)
    for name, snap in after["instances"].items():
        base = before["instances"].get(name)
        if base is None or base["pid"] != snap["pid"]:
            base = first_of_role.get(snap["role"], base)
        kv_blocks_leaked += blocks_over(snap, base)
        found = []
        if "error" in snap:
            found.append(f"unreachable: {snap['error']}")
        for key in (*_SERVE_METRICS, *_ATTN_METRICS, "retained_past_ttl"):
            if key in snap and snap[key] > (base or {}).get(key, 0.0) + 1e-9:
                found.append(f"{key} = {snap[key]:g} (start {(base or {}).get(key, 0.0):g})")
        for key in ("processes", "sockets"):
            if base and snap[key] > base[key]:
                found.append(f"{key} {snap[key]} (start {base[key]})")
        if base and snap["threads"] > base["threads"] + thread_slack:
            grew = {n: c - base["thread_names"].get(n, 0) for n, c in snap["thread_names"].items()
                    if c > base["thread_names"].get(n, 0)}
            found.append(f"threads {snap['threads']} (start {base['threads']}; more of {grew})")
        if found:
            leaks[name] = found
    new_shm = sorted(n for n in set(after["shm"]) - set(before["shm"]) - set(after.get("shm_mapped", ()))
                     if not n.startswith(SEMAPHORE_PREFIX))
    return {"leaks": leaks, "new_shm": new_shm,
            "kv_blocks_leaked": kv_blocks_leaked, "shm_segments_leaked": len(new_shm)}


def left_after_stop(at_start: set[str]) -> list[str]:
    """/dev/shm entries that appeared since `at_start` (taken before the deployment started) and are
    still there now that it stopped: what neither its processes nor `up`'s sweep removed."""
    return sorted(shm_entries() - at_start)


def settled_snapshot(take, before: dict, bound_s: float, period_s: float = 2.0) -> tuple[dict, float]:
    """The end snapshot (`take()`) once nothing is held beyond `before`, or the last one at `bound_s`.
    P keeps a finished prefill's blocks until D registers or its push timeout passes, and a request
    whose router was killed before D registered is freed only then (the seed-1 Lamina soak: 3 blocks
    held 28 s after a router restart, freed 10 s after the snapshot). Returns (snapshot, seconds
    waited): a leak is what is still held past that bound."""
    t0 = time.monotonic()
    while True:
        end = take()
        diff = compare(before, end)
        waited = time.monotonic() - t0
        if (not diff["leaks"] and not diff["kv_blocks_leaked"]) or waited >= bound_s:
            return end, round(waited, 1)
        time.sleep(period_s)
