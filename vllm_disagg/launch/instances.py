# SPDX-License-Identifier: Apache-2.0
"""What a local deployment runs: one `InstanceSpec` per instance (role, ports, cores), the command
line of each (`vllm serve` with vLLM's native flags, or `vllm-disagg attn-server`), its
environment, free ports and core slices. Plain functions; `local.py` starts and supervises them."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("vllm_disagg.launch.local")

HOST = "127.0.0.1"
# A failed or stalled push makes D recompute the prompt (pd_protocol.md step 5), never fail the request.
CONNECTOR = {"kv_connector": "DisaggConnector", "kv_connector_module_path": "vllm_disagg.kv.connector",
             "kv_load_failure_policy": "recompute"}
_KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


class LaunchError(RuntimeError):
    """An instance did not come up; the message names it and points at its log."""


@dataclass
class InstanceSpec:
    """One vLLM server of the deployment."""

    role: str
    """prefill | decode | mixed | attention (a `vllm-disagg attn-server`, not a vLLM engine)"""
    index: int
    http_port: int
    kv_port: int | None
    cores: str
    """Value of VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "2-3"."""
    kv_extra: dict = field(default_factory=dict)
    """More `additional_config["disagg"]["kv"]` settings (e.g. layerwise_threshold_tokens)."""
    env: dict = field(default_factory=dict)
    """More environment for this instance only."""
    args: list = field(default_factory=list)
    """More `vllm serve` arguments for this instance only (after the shared ones)."""
    disagg_extra: dict = field(default_factory=dict)
    """More `additional_config["disagg"]` sections (remote_attention, nanoflow) for this instance."""

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def kv_addr(self) -> str | None:
        return None if self.kv_port is None else f"{HOST}:{self.kv_port}"


def free_ports(num: int, exclude: Collection[int] = ()) -> list[int]:
    """Ports free right now (held open together so they are distinct), chosen below the kernel's
    ephemeral range: a bind(0) port is the kind a vLLM engine starting beside ours takes for its own
    sockets before our instance binds it (seen in CI: a prefill's KV port, "Address already in use").
    `exclude`: ports an earlier draw handed out that may not be bound yet (free now, taken soon)."""
    return free_port_runs([1] * num, exclude)


def free_port_runs(lengths: list[int], exclude: Collection[int] = ()) -> list[int]:
    """One base port per entry of `lengths`, each the first of that many consecutive free ports,
    all distinct (TP rank r of a P/D instance serves KV on its kv_port + r). As `free_ports`."""
    low, high = _static_port_range()
    excluded = set(exclude)
    socks: list[socket.socket] = []
    bases: list[int] = []
    try:
        candidates = iter(secrets.SystemRandom().sample(range(low, high), k=min(high - low, 64 * len(lengths))))
        for length in lengths:
            for base in candidates:
                if not excluded.isdisjoint(range(base, base + length)):
                    continue
                run = _bind_run(base, length)
                if run:
                    socks += run
                    bases.append(base)
                    break
            else:  # no static range on this host (or it is full): the OS's pick, then its neighbours
                bases.append(_os_run(length, socks, excluded))
        return bases
    finally:
        for s in socks:
            s.close()


def _bind_run(base: int, length: int) -> list[socket.socket]:
    """Sockets bound to base .. base + length - 1, or [] (none left open) when one is taken."""
    run: list[socket.socket] = []
    for port in range(base, base + length):
        s = socket.socket()
        try:
            s.bind((HOST, port))
        except (OSError, OverflowError):
            s.close()
            for r in run:
                r.close()
            return []
        run.append(s)
    return run


def _os_run(length: int, socks: list[socket.socket], excluded: set[int]) -> int:
    for _ in range(100):
        first = socket.socket()
        first.bind((HOST, 0))
        base = first.getsockname()[1]
        in_use = not excluded.isdisjoint(range(base, base + length))
        rest = _bind_run(base + 1, length - 1) if length > 1 and not in_use else []
        if not in_use and (length == 1 or rest):
            socks += [first, *rest]
            return base
        first.close()
    raise OSError(f"no run of {length} consecutive free ports")


def _static_port_range() -> tuple[int, int]:
    """[20000, start of the ephemeral range): above Ray's worker ports (10002-19999), below the
    ports the kernel hands out for bind(0)/connect(); empty when the host's range starts lower."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    return 20000, max(20000, ephemeral_low)


def core_slices(num_instances: int, cores_per_instance: int, cores: list[int] | None = None) -> list[str]:
    """Round-robin slices of this process's CPUs, one per instance (wrapping when there are too few)."""
    cpus = sorted(cores if cores is not None else os.sched_getaffinity(0))
    out = []
    for i in range(num_instances):
        start = (i * cores_per_instance) % len(cpus)
        chosen = [cpus[(start + k) % len(cpus)] for k in range(min(cores_per_instance, len(cpus)))]
        out.append(",".join(str(c) for c in sorted(set(chosen))))
    return out


def rank_core_slices(num_instances: int, cores_per_instance: int, tp_size: int = 1,
                     cores: list[int] | None = None) -> list[str]:
    """`core_slices` for instances of `tp_size` ranks: "a|b" (VLLM_CPU_OMP_THREADS_BIND, rank by rank).

    Each rank gets its own slice when there are cores enough; else the ranks of an instance share
    the instance's slice: two P/D engines whose ranks spread over each other's cores made the prefill
    forward ~37x slower in test_pd_tp.py (the decode side busy-polls while it waits for KV)."""
    cpus = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if num_instances * tp_size * cores_per_instance <= len(cpus):
        flat = core_slices(num_instances * tp_size, cores_per_instance, cpus)
        return ["|".join(flat[i * tp_size:(i + 1) * tp_size]) for i in range(num_instances)]
    return ["|".join([s] * tp_size) for s in core_slices(num_instances, cores_per_instance, cpus)]


def plan_instances(num_prefill: int, num_decode: int, num_mixed: int, cores_per_instance: int = 1,
                   ports: list[int] | None = None, num_attention: int = 0, tp_size: int = 1,
                   exclude: Collection[int] = ()) -> list[InstanceSpec]:
    """Ports and cores for every instance; with no P/D and no mixed, one plain (mixed) instance.
    `exclude`: ports the caller holds or will bind (the router's `--port`), never drawn.

    Attention servers come first (they must be up before their model worker starts). With
    `tp_size` > 1 each P/D instance's kv_port is the first of `tp_size` free ports (rank r serves on
    kv_port + r, where the other side's rank r finds it) and each rank gets its own core slice."""
    if num_prefill and not num_decode:
        raise ValueError("--prefill needs at least one --decode instance to push to")
    if tp_size > 1 and num_attention:
        raise ValueError(f"--attention with --tensor-parallel-size {tp_size}: remote attention runs at TP=1 only")
    if not (num_prefill or num_decode or num_mixed):
        num_mixed = 1
    roles = (["attention"] * num_attention + ["prefill"] * num_prefill + ["decode"] * num_decode
             + ["mixed"] * num_mixed)
    num_kv = num_prefill + num_decode
    ports = ports or free_port_runs([1] * len(roles) + [tp_size] * num_kv, exclude)
    cores = rank_core_slices(len(roles), cores_per_instance, tp_size)
    counts = dict.fromkeys(("attention", "prefill", "decode", "mixed"), 0)
    specs, kv_ports = [], iter(ports[len(roles):])
    for i, role in enumerate(roles):
        kv_port = next(kv_ports) if role in _KV_ROLE else None
        specs.append(InstanceSpec(role, counts[role], ports[i], kv_port, cores[i]))
        counts[role] += 1
    return specs


_TP_FLAGS = ("--tensor-parallel-size", "--tensor_parallel_size", "-tp")


def tensor_parallel_size(vllm_args: list[str]) -> int:
    """The `--tensor-parallel-size` (`-tp`) among the arguments `up` passes to vLLM, else 1."""
    size = "1"
    for i, arg in enumerate(vllm_args):
        name, eq, value = arg.partition("=")
        if name in _TP_FLAGS:
            size = value if eq else (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
    try:
        if int(size) >= 1:
            return int(size)
    except ValueError:
        pass
    raise ValueError(f"--tensor-parallel-size {size!r}: expected a positive integer")


LIVE_MIDDLEWARE = "vllm_disagg.liveness.LiveMiddleware"


def serve_command(spec: InstanceSpec, model: str, transport: str, extra_args: list[str],
                  served_name: str | None = None, vllm_cmd: list[str] | None = None) -> list[str]:
    """The `vllm serve` command line of one instance (native flags; unknown args passed through)."""
    if spec.role == "attention":
        return attn_server_command(spec)
    cmd = [*(vllm_cmd or vllm_serve_prefix()), model, "--host", HOST, "--port", str(spec.http_port),
           "--middleware", LIVE_MIDDLEWARE]  # GET /live: the engine's step progress (the router's hang detection)
    if served_name and "--served-model-name" not in extra_args:
        cmd += ["--served-model-name", served_name]
    disagg = dict(spec.disagg_extra)
    if spec.role in _KV_ROLE:
        cmd += ["--kv-transfer-config", json.dumps({**CONNECTOR, "kv_role": _KV_ROLE[spec.role]})]
        disagg.update(role=spec.role, kv={"kv_port": spec.kv_port, "transport": transport, **spec.kv_extra})
    elif "remote_attention" in disagg:  # the model worker without P/D: the connector restores retained KV
        cmd += ["--kv-transfer-config", json.dumps({**CONNECTOR, "kv_role": "kv_consumer"})]
    if disagg:
        cmd += ["--additional-config", json.dumps({"disagg": disagg})]
    if any(a.startswith("--disagg-") for a in extra_args) and "--plugin" not in extra_args:
        cmd += ["--plugin", "disagg"]  # e.g. `up --disagg-nano-batches 2`: folded into additional_config
    return cmd + list(extra_args) + list(spec.args)


@dataclass
class AttentionPlan:
    """`up --attention K`: K attention servers serving one model-worker instance."""

    num: int = 0
    partition: str = "auto"
    """auto | head | request (RemoteAttentionSection.partition)"""
    pipeline: int = 1
    """1, or 2 for ping-pong pipelining (runs on the NanoFlow nano-batch executor)"""
    transport: str = "shm"
    """Data path of the per-layer exchange."""
    kv_cache_gib: float | None = None
    """KV memory of each attention server (None: the server's default; `up` sizes it, attention_sizing.py)."""
    send_q_early: bool | None = None
    """None keeps the config default."""
    kv_transport: str | None = None
    """With prefill instances: the servers accept their KV pushes on this transport (= `up --transport`)."""
    kv_advertise: list[str] | None = None
    """One HOST:PORT per server that prefill instances connect to for its KV (`--attention-kv-advertise`)."""


ONE_KV_GROUP_FLAG = "--disable-hybrid-kv-cache-manager"
"""A prefill instance pushing into attention servers allocates like its decode model worker: one KV cache
group (vLLM's hybrid allocator keeps a sliding-window group's out-of-window blocks from it)."""


def attach_attention(specs: list[InstanceSpec], plan: AttentionPlan,
                     exclude: Collection[int] = ()) -> InstanceSpec | None:
    """Point the model worker (the decode instance, or the only mixed one without P/D) at the servers.

    A server holds the KV of exactly one model worker (attention/README "Limits"), so K servers serve
    one instance. Prefill instances push their KV straight into the servers (`kv/lamina/targets.py`)."""
    servers = [f"{HOST}:{s.http_port}" for s in specs if s.role == "attention"]
    if not servers:
        return None
    users = [s for s in specs if s.role in ("decode", "mixed")]
    if len(users) != 1:
        raise ValueError("--attention K serves exactly one model worker: use one --decode (or one instance "
                         f"without --prefill), got {[s.name for s in users]}")
    remote_attention = {"servers": servers, "partition": plan.partition, "pipeline": plan.pipeline, "transport": plan.transport}
    if plan.send_q_early is not None:
        remote_attention["send_q_early"] = plan.send_q_early
    users[0].disagg_extra["remote_attention"] = remote_attention
    if plan.pipeline > 1:  # n=2 ping-pong = the NanoFlow nano-batch executor (one overlap mechanism)
        users[0].disagg_extra["nanoflow"] = {"num_nano_batches": plan.pipeline}
    advertised = iter(_kv_advertise(plan, specs, len(servers)))
    kv_ports = iter(_attention_kv_ports(specs, exclude))
    for s in specs:
        if s.role == "prefill":  # the servers hold one block table per request (handshake kv_groups)
            s.args = [*s.args, ONE_KV_GROUP_FLAG]
        if s.role == "attention":
            size = [] if plan.kv_cache_gib is None else ["--kv-cache-gib", str(plan.kv_cache_gib)]
            s.args = ["--transport", plan.transport, *size, *s.args]
            if plan.kv_transport and any(p.role == "prefill" for p in specs):
                s.args += ["--kv-transport", plan.kv_transport]
                if plan.kv_transport in ("tcp", "nixl"):  # kept across restarts: the model worker advertised it
                    s.args += ["--kv-port", str(next(kv_ports))]
                if plan.kv_advertise:
                    s.args += ["--kv-advertise", next(advertised)]
    return users[0]


def _attention_kv_ports(specs: list[InstanceSpec], exclude: Collection[int] = ()) -> list[int]:
    """A KV ingest port per attention server (used where its KV transport listens on one), drawn apart
    from every port `specs` hold: a server binds it only when its model worker connects, and a draw of
    its own handed attention1 the HTTP port of attention0 (CI, stop 45: "Address already in use" at the
    first INIT, the deployment did not start)."""
    taken = {s.http_port for s in specs} | {s.kv_port for s in specs if s.kv_port is not None} | set(exclude)
    return free_ports(sum(s.role == "attention" for s in specs), exclude=taken)


def _kv_advertise(plan: AttentionPlan, specs: list[InstanceSpec], num_servers: int) -> list[str]:
    """`--attention-kv-advertise`, checked: one HOST:PORT per server, tcp KV pushes from prefill instances."""
    from vllm_disagg.config import check_host_port

    if not plan.kv_advertise:
        return []
    if not any(p.role == "prefill" for p in specs) or plan.kv_transport != "tcp":
        raise ValueError("--attention-kv-advertise needs prefill instances pushing over --transport tcp "
                         "(the address stands in front of a server's tcp KV receiver)")
    if len(plan.kv_advertise) != num_servers:
        raise ValueError(f"--attention-kv-advertise names {len(plan.kv_advertise)} addresses for {num_servers} "
                         "attention servers: give one per server")
    return [check_host_port(addr) for addr in plan.kv_advertise]


def parse_cores(cores: str) -> set[int]:
    """"0", "2-3", "0,2-3" or "0|1" (VLLM_CPU_OMP_THREADS_BIND syntax; "|" between TP ranks) -> {0},
    {2, 3}, {0, 2, 3}, {0, 1}: every core of the instance."""
    out: set[int] = set()
    for part in cores.replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def bind_process(pid: int, cores: str) -> None:
    """Restrict a just-started child to `cores`; the processes and threads it starts inherit it.

    Popen returns once the child has exec'd, before the new interpreter starts any thread, so the
    whole tree ends up bound."""
    try:
        os.sched_setaffinity(pid, parse_cores(cores))
    except (OSError, ValueError) as err:  # cores not allowed here, or the child already exited
        logger.warning("cannot bind pid %d to cores %s: %s", pid, cores, err)


def attn_server_command(spec: InstanceSpec) -> list[str]:
    """`vllm-disagg attn-server` of one attention server; it exits with the launcher (--parent-pid)."""
    threads = len(spec.cores.split(","))
    return [sys.executable, "-m", "vllm_disagg.attention.cli", "--host", HOST, "--http-port", str(spec.http_port),
            "--threads", str(threads), "--parent-pid", str(os.getpid()), *spec.args]


def vllm_serve_prefix() -> list[str]:
    """`<venv>/bin/vllm serve` when the CLI works; else vLLM's api_server module (no CLI shim needed)."""
    exe = Path(sys.executable).with_name("vllm")
    if exe.exists():
        return [str(exe), "serve"]
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]


def instance_env(spec: InstanceSpec, kv_cache_gib: int | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """None for `kv_cache_gib` leaves the KV size to vLLM's own `--kv-cache-memory-bytes`."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_OMP_THREADS_BIND=spec.cores, VLLM_HOST_IP=HOST, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if kv_cache_gib is None:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env.update(spec.env)
    return env
