# SPDX-License-Identifier: Apache-2.0
"""The faults the chaos campaign injects, on the plugin's own processes and listeners.

Kinds (`KINDS`): SIGKILL of an instance's process group (prefill, decode / model worker, attention
server); SIGSTOP of a whole group for 5-30 s, or of its EngineCore alone (the API server keeps
answering: only `/live` sees it); a slow peer (the group stopped and continued on a duty cycle, half
its time gone); a throttled KV link into the decode instance or, with attention servers, into one of
them (`slow_link`: a proxy the receiver advertises, `Deployment(slow_link=True)`, links.py); one byte
flipped on such a link (`corrupt_link`, with `--disagg-kv-verify on`: the push's checksums must catch it,
and the answer stay right); garbage, truncated and oversized frames from strangers on every KV and attention port;
malformed, huge and slowloris HTTP on the router and the instances; SIGKILL of one of the routers
(restarted at once: the other one behind the same port keeps serving). Every fault is bounded in time
and undoes itself (SIGCONT, restart), so the run always ends with everything up.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_disagg.errors import DisaggError
from vllm_disagg.testing.chaos.leaks import children, metrics
from vllm_disagg.testing.fuzz import FuzzTarget, _stranger
from vllm_disagg.testing.http import answers

KINDS = ("kill", "stop", "stop_engine", "slow", "slow_link", "corrupt_link", "garbage_frames", "bad_http",
         "router_restart")
LINK_KINDS = ("slow_link", "corrupt_link")
"""Faults on a KV link (P -> D, or P -> an attention server): they need `Deployment(slow_link=True)`."""
SLOW_LINK_BYTES_PER_S = 16 << 10
"""The `slow_link` fault's rate into the decode instance's KV receiver: a long prompt's push then outlasts
the push timeout, and the prefill side cannot answer the CANCEL in time (the receiver's fence is tested)."""


@dataclass
class Fault:
    kind: str
    target: str
    t_start: float
    t_end: float = 0.0
    detail: dict = field(default_factory=dict)

    def as_dict(self, t0: float) -> dict:
        return {"kind": self.kind, "target": self.target, "t_start_s": round(self.t_start - t0, 3),
                "t_end_s": round(self.t_end - t0, 3), **self.detail}


def engine_core_pid(api_pid: int) -> int | None:
    """The EngineCore process of a `vllm serve` (a child of its API server)."""
    for child in children(api_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{child}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if "EngineCor" in comm or b"EngineCore" in cmd:  # vLLM names it VLLM::EngineCore (comm: 15 chars)
            return child
    return None


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class FaultInjector:
    """Runs one fault at a time against a deployment (`Deployment` from deployment.py)."""

    def __init__(self, deployment, rng: random.Random, log: Callable[[str], None] = print) -> None:
        self.d, self.rng, self.log = deployment, rng, log

    # ------------------------------------------------------------------ process faults
    def kill(self, role: str) -> Fault:
        inst = self.d.pick(role, self.rng)
        fault = Fault("kill", inst["name"], time.monotonic(), detail={"pid": inst["pid"]})
        self.log(f"SIGKILL {inst['name']} (pgid {inst['pid']})")
        if role == "router":
            self.d.kill_router(inst)
        elif inst.get("actor_pid") and self.rng.random() < 0.5:  # a Ray actor: its reaper takes the server along
            fault.detail["actor_pid"] = inst["actor_pid"]
            self.log(f"  (the Ray actor, pid {inst['actor_pid']})")
            _quiet(os.kill, inst["actor_pid"], signal.SIGKILL)
        else:
            signal_group(inst["pid"], signal.SIGKILL)
            if role == "attention":
                self.d.restart_attention(inst)
        fault.t_end = time.monotonic()
        if role != "router":  # a router is back at once (restarted in place)
            self._watch_back(fault, inst["name"], inst["pid"])
        return fault

    def _watch_back(self, fault: Fault, name: str, old_pid: int) -> None:
        """In the background: when a new process of the killed instance `name` answers `/health`, set
        `back_after_s` (the report's window for the kill; cuts.py). A Ray restart took 94 s under load,
        past the fixed 60 s, so requests that had no serving instance were counted as having one."""
        def run() -> None:
            deadline = time.monotonic() + BACK_TIMEOUT_S
            while time.monotonic() < deadline:
                time.sleep(1.0)
                try:
                    new = [i for i in self.d.instances() if i["name"] == name and i.get("pid") != old_pid]
                    if new and answers(f"{new[0]['url']}/health", timeout_s=2.0):
                        fault.detail["back_after_s"] = round(time.monotonic() - fault.t_start, 1)
                        return
                except Exception:  # noqa: BLE001 (a state file mid-write, GCS busy: ask again)
                    continue

        threading.Thread(target=run, name=f"chaos-back-{name}", daemon=True).start()

    def stop(self, role: str, seconds: float, engine_only: bool = False) -> Fault:
        inst = self.d.pick(role, self.rng)
        pid = engine_core_pid(inst["pid"]) if engine_only else None
        kind = "stop_engine" if engine_only else "stop"
        fault = Fault(kind, inst["name"], time.monotonic(), detail={"seconds": round(seconds, 1)})
        self.log(f"SIGSTOP {inst['name']}{' EngineCore ' + str(pid) if pid else ''} for {seconds:.1f} s")
        if engine_only and pid is None:
            fault.detail["skipped"] = "no EngineCore child found"
            fault.t_end = time.monotonic()
            return fault
        send = (lambda sig: os.kill(pid, sig)) if engine_only else (lambda sig: signal_group(inst["pid"], sig))
        try:
            send(signal.SIGSTOP)
            if engine_only:  # what the routers read: does /live say the engine owes progress, and by when?
                fault.detail["live"] = sample_live(inst["url"], seconds)
            else:
                time.sleep(seconds)
        finally:
            _quiet(send, signal.SIGCONT)
        fault.t_end = time.monotonic()
        return fault

    def slow(self, role: str, seconds: float, duty: float = 0.5, period_s: float = 0.1) -> Fault:
        """A slow peer: the group runs only `1 - duty` of each period (a throttled process)."""
        inst = self.d.pick(role, self.rng)
        fault = Fault("slow", inst["name"], time.monotonic(), detail={"seconds": round(seconds, 1), "duty": duty})
        self.log(f"slowing {inst['name']} to {1 - duty:.0%} for {seconds:.1f} s")
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                signal_group(inst["pid"], signal.SIGSTOP)
                time.sleep(period_s * duty)
                signal_group(inst["pid"], signal.SIGCONT)
                time.sleep(period_s * (1 - duty))
        finally:
            signal_group(inst["pid"], signal.SIGCONT)
        fault.t_end = time.monotonic()
        return fault

    def slow_link(self, seconds: float, rate_bytes_per_s: float = SLOW_LINK_BYTES_PER_S) -> Fault:
        """A KV link throttled for `seconds`: into the decode instance (P/D), or into one attention server
        (Lamina: the KV lands there, `links.py`)."""
        name, link = self._link()
        fault = Fault("slow_link", name or "decode", time.monotonic(),
                      detail={"seconds": round(seconds, 1), "bytes_per_s": rate_bytes_per_s})
        if link is None:
            fault.detail["skipped"] = "no throttled KV link (Deployment(slow_link=True) with one decode instance)"
            fault.t_end = time.monotonic()
            return fault
        self.log(f"throttling the KV link into {name} to {rate_bytes_per_s / 1024:.0f} KiB/s for {seconds:.1f} s")
        link.set_rate(rate_bytes_per_s)
        try:
            time.sleep(seconds)
        finally:
            link.set_rate(None)
        fault.t_end = time.monotonic()
        return fault

    def corrupt_link(self, seconds: float) -> Fault:
        """One byte of a KV link (into the decode instance, or into an attention server) flipped, 4-64 KiB
        past what has gone through (inside a push's payload, where no frame check looks): with
        `--disagg-kv-verify on` the push's end-to-end checksums catch it and D recomputes, so the answer is
        still plain vLLM's. D (the model worker, with attention servers) counts the mismatch."""
        name, link = self._link()
        fault = Fault("corrupt_link", name or "decode", time.monotonic(), detail={"seconds": round(seconds, 1)})
        if link is None or not self.d.kv_verify:
            fault.detail["skipped"] = "needs Deployment(slow_link=True, kv_verify=True) with one decode instance"
            fault.t_end = time.monotonic()
            return fault
        decode = self.d.pick("decode", self.rng)
        before, flipped = _mismatches(decode["url"]), link.num_corrupted
        link.flip_after(self.rng.randrange(4 << 10, 64 << 10))
        self.log(f"flipping a byte on the KV link into {name} within {seconds:.0f} s")
        deadline = time.monotonic() + seconds
        while link.num_corrupted == flipped and time.monotonic() < deadline:
            time.sleep(0.2)
        link.cancel_flip()
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))  # D verifies after the last byte landed
        fault.detail.update(flipped=link.num_corrupted - flipped, instance=name,
                            checksum_mismatches=_mismatches(decode["url"]) - before)
        fault.t_end = time.monotonic()
        return fault

    def _link(self):
        """(receiving instance's name, its proxy) of a KV link at random; (None, None) without links."""
        return self.d.links.pick(self.rng) if self.d.links is not None else (None, None)

    # ------------------------------------------------------------------ input faults
    def garbage_frames(self, num_per_port: int = 200) -> Fault:
        """Strangers' garbage, truncated and oversized frames on every KV and attention port."""
        ports = self.d.binary_ports()
        fault = Fault("garbage_frames", ",".join(name for name, _ in ports), time.monotonic(),
                      detail={"frames_per_port": num_per_port, "ports": len(ports)})
        self.log(f"garbage frames on {len(ports)} ports")
        skipped = []
        for name, address in ports:
            target = FuzzTarget(name, address, b"msg", "not-the-token")
            for _ in range(num_per_port):
                try:
                    _stranger(self.rng, target)
                except (OSError, DisaggError):
                    skipped.append(name)  # refused: its process is restarting (an earlier fault)
                    break
        fault.detail["skipped_ports"] = skipped
        fault.t_end = time.monotonic()
        return fault

    def bad_http(self, seconds: float = 10.0) -> Fault:
        """Malformed JSON, a huge body and slowloris connections on the router and every instance."""
        urls = self.d.http_urls()
        fault = Fault("bad_http", ",".join(urls), time.monotonic(), detail={"seconds": seconds})
        self.log(f"bad HTTP on {len(urls)} endpoints for {seconds:.0f} s")
        loris = [threading.Thread(target=_slowloris, args=(u, seconds), daemon=True) for u in urls]
        for t in loris:
            t.start()
        statuses = {}
        for url in urls:
            statuses[url] = [_post_raw(url, body) for body in _BAD_BODIES] + [_post_huge(url)]
        for t in loris:
            t.join(seconds + 10)
        fault.detail["statuses"] = statuses
        fault.t_end = time.monotonic()
        return fault


_BAD_BODIES = (b"{not json", b"[]", b'{"model": 1, "prompt": {"x": []}, "max_tokens": -5}',
               b'{"prompt": "x", "max_tokens": 99999999999999999999}', b"\xff\xfe\x00garbage",
               b'{"messages": "not a list"}')


def _mismatches(url: str) -> float:
    """D's count of pushes whose checksums disagreed with P's (0 when D is down: a kill may overlap)."""
    try:
        return metrics(url, (_MISMATCHES,))[_MISMATCHES]
    except OSError:
        return 0.0


_MISMATCHES = "vllm:disagg_kv_checksum_mismatches_total"


def _split(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


def _post_raw(url: str, body: bytes, path: str = "/v1/completions") -> int:
    host, port = _split(url)
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                      b"Connection: close\r\n\r\n" % (path.encode(), len(body)) + body)
            s.settimeout(30)
            head = s.recv(64)
        return int(head.split()[1]) if head.startswith(b"HTTP/") else -1
    except (OSError, ValueError, IndexError):
        return -1


def _post_huge(url: str, nbytes: int = 80 << 20) -> int:
    """A body past every server's limit, announced up front; the server should refuse, not buffer it."""
    host, port = _split(url)
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\nConnection: close\r\n\r\n" % nbytes)
            chunk = b'{"prompt": "' + b"a" * (1 << 20)
            sent = 0
            s.settimeout(5)
            while sent < nbytes:
                try:
                    s.sendall(chunk[: min(len(chunk), nbytes - sent)])
                except OSError:
                    break  # refused mid-body: what we want
                sent += len(chunk)
            s.settimeout(30)
            head = s.recv(64)
        return int(head.split()[1]) if head.startswith(b"HTTP/") else -1
    except (OSError, ValueError, IndexError):
        return -1


def _slowloris(url: str, seconds: float, num: int = 20) -> None:
    host, port = _split(url)
    socks = []
    end = time.monotonic() + seconds
    try:
        for _ in range(num):
            try:
                s = socket.create_connection((host, port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            except OSError:
                break
        while time.monotonic() < end:
            for s in list(socks):
                try:
                    s.sendall(b"X-a: b\r\n")
                except OSError:
                    socks.remove(s)
            time.sleep(1.0)
    finally:
        for s in socks:
            s.close()


BACK_TIMEOUT_S = 300.0
"""How long a killed instance's return is watched for (`back_after_s`)."""


LIVE_FIELDS = ("stalled_s", "expected_step_s", "expected_progress_s", "num_step_samples", "inflight", "engine_busy")


def sample_live(url: str, seconds: float, period_s: float = 1.0) -> list[dict]:
    """`/live` of an instance whose engine is stopped, every `period_s` for `seconds` (the report keeps why
    a router did or did not mark it suspect: a Ray decode instance was cut only at the fixed limit)."""
    samples, start = [], time.monotonic()
    end = start + seconds
    while (now := time.monotonic()) < end:
        try:
            with urllib.request.urlopen(f"{url}/live", timeout=min(1.0, end - now)) as resp:
                report = json.loads(resp.read())
            samples.append({"t_s": round(now - start, 2), **{k: report.get(k) for k in LIVE_FIELDS}})
        except (OSError, ValueError) as err:
            samples.append({"t_s": round(now - start, 2), "error": type(err).__name__})
        time.sleep(max(0.0, min(period_s, end - time.monotonic())))
    return samples


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass
