# SPDX-License-Identifier: Apache-2.0
"""The deployments serve_bench.py compares, each started the way its user starts it, on the same two cores.

- `plain_default` / `plain_bind01`: one `vllm serve` on cores 0-1 (`taskset -c 0,1`), with vLLM's own
  binding (it computes on one core and reserves the other for its API server and EngineCore) or with
  `VLLM_CPU_OMP_THREADS_BIND=0-1` (compute on both);
- `vllm_nixl` (`vllm_nixl_push`): vLLM's NixlConnector 1P+1D, pull (push) mode, each `vllm serve` on one core
  (`taskset` + `VLLM_CPU_OMP_THREADS_BIND`), behind `vllm-disagg router --pd-protocol vllm`;
  `vllm_nixl_inline`: the same without NIXL's UCX progress thread, which spins a core per engine
  (nixl_inline/sitecustomize.py; a secondary baseline, not what vLLM runs by default);
- `ours_tcp` / `ours_shm` / `ours_nano`: `vllm-disagg up --prefill 1 --decode 1` over tcp or shm (nano:
  `--disagg-num-nano-batches auto`), which binds each instance's process tree to its core.
Every process (and the client) may use cores 0-1; `placement` records where each one actually sits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from vllm_disagg.launch.local import free_ports, vllm_serve_prefix
from vllm_disagg.testing.http import answers

HOST = "127.0.0.1"
SERVED_NAME = "smollm2-135m"
BASE_ENV = {"VLLM_HOST_IP": HOST, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "UCX_NET_DEVICES": "lo"}
KV_GIB_PER_INSTANCE = 1
"""P and D get 1 GiB of KV each (`vllm-disagg up`'s default); plain gets their sum."""
# NIXL at its best on this box: one UCX thread (4 spin on 2 cores and starve the engines, pd_bench
# finding), and every prompt pulled (the default skips pulls under 64 tokens and recomputes them).
NIXL_EXTRA = {"num_threads": 1, "kv_recompute_threshold": 0}


@dataclass(frozen=True)
class Deployment:
    name: str
    kind: str
    """plain | vllm_nixl | ours"""
    omp_bind: str | None = None
    transport: str = "tcp"
    nano: bool = False
    connector: str = "NixlConnector"
    env: tuple[tuple[str, str], ...] = ()
    """More environment for every process of the deployment."""
    traced: bool = False
    """ours only: `up --trace` (every process exports its spans at the default sampling to a receiver in
    `up`'s process, on the same cores): what tracing costs (issue 20's tracing_overhead_ratio)."""
    up_args: tuple[str, ...] = ()
    """ours only: more `vllm-disagg up` flags (e.g. the router's overflow thresholds)."""

    @property
    def is_pd(self) -> bool:
        return self.kind != "plain"


DEPLOYMENTS = {d.name: d for d in (
    Deployment("plain_default", "plain"),
    Deployment("plain_bind01", "plain", omp_bind="0-1"),
    Deployment("vllm_nixl", "vllm_nixl"),
    Deployment("vllm_nixl_push", "vllm_nixl", connector="NixlPushConnector"),
    Deployment("vllm_nixl_ucx_tcp", "vllm_nixl", env=(("UCX_TLS", "tcp,self"),)),
    # NIXL without its spinning progress thread (nixl_inline/sitecustomize.py): a secondary baseline
    Deployment("vllm_nixl_inline", "vllm_nixl", env=(("PYTHONPATH", str(Path(__file__).parent / "nixl_inline")),
                                                     ("UCX_RCACHE_MAX_UNRELEASED", "1024"))),
    Deployment("ours_tcp", "ours", transport="tcp"),
    Deployment("ours_shm", "ours", transport="shm"),
    Deployment("ours_nano", "ours", transport="tcp", nano=True),
    Deployment("ours_traced", "ours", transport="tcp", traced=True),
    # The router's default mixed pool (P's prompt queue in seconds) off: every request P then D
    Deployment("ours_pd_only", "ours", transport="tcp", up_args=("--prefill-queue-s", "0", "--colocate-queue-s", "0")),
    # The default's colocate rule alone: P keeps a request whole past 4 s of prompt queue, D never prefills
    Deployment("ours_colocate_only", "ours", transport="tcp", up_args=("--prefill-queue-s", "0")),
    # Splitwise's mixed pool sooner: once D has 2048 output tokens pending, P also decodes whole requests
    Deployment("ours_mixed", "ours", transport="tcp", up_args=("--decode-queue-threshold", "2048", "--prefill-queue-s", "0",
                                                               "--colocate-queue-s", "0")),
    # ... and D also prefills whole requests once P has 4096 prompt tokens pending (the planner's what-if
    # of the Azure window at 1 req/s: 95.6 output tok/s against 75.7 without the mixed pool)
    Deployment("ours_mixed_both", "ours", transport="tcp",
               up_args=("--prefill-queue-threshold", "4096", "--decode-queue-threshold", "2048",
                        "--prefill-queue-s", "0", "--colocate-queue-s", "0")),
)}


@dataclass
class Running:
    deployment: Deployment
    url: str
    """What the client talks to (the router for P/D)."""
    instances: dict[str, str]
    """role (plain, prefill, decode, router) -> base URL with /metrics."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    placement: dict = field(default_factory=dict)
    log_dir: Path | None = None
    start_s: float = 0.0


def engine_dtype() -> str:
    """`--dtype` of every instance: the model's own (bf16 for SmolLM2) where this CPU has bf16
    instructions (AVX512-BF16 or AMX), else float32. Without them torch emulates bf16: one core's
    576x1536 GEMM ran at 1.4 GFLOP/s against 63 in float32 on an AVX2-only AMD EPYC, and a 500-token
    prefill took over a minute, so every deployment timed out the same way and nothing was compared."""
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "auto" if native else "float32"


def vllm_args(max_model_len: int) -> list[str]:
    """Shared by every instance of every deployment. Eager: inductor compiles for ~2 min per start here
    and gave no speed (vllm-cpu-on-this-box.md §3)."""
    return ["--max-model-len", str(max_model_len), "--enforce-eager", "--disable-uvicorn-access-log",
            "--dtype", engine_dtype()]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    return {**env, **BASE_ENV, **extra}


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _serve(model: str, port: int, args: list[str]) -> list[str]:
    return [*vllm_serve_prefix(), model, "--host", HOST, "--port", str(port), "--served-model-name", SERVED_NAME,
            *args]


@contextlib.contextmanager
def started(dep: Deployment, model: str, max_model_len: int, log_dir: Path, timeout_s: float = 600):
    """Start `dep`, wait until it serves, yield its `Running`, stop every process group on exit."""
    run = Running(dep, "", {}, log_dir=log_dir, start_s=time.monotonic())
    try:
        {"plain": _start_plain, "vllm_nixl": _start_nixl, "ours": _start_ours}[dep.kind](run, model, max_model_len)
        _wait_ready(run, timeout_s)
        run.start_s = time.monotonic() - run.start_s
        run.placement = placement(run.procs)
        yield run
    finally:
        stop(run.procs)


def _start_plain(run: Running, model: str, max_model_len: int) -> None:
    port = free_ports(1)[0]
    extra = {"VLLM_CPU_KVCACHE_SPACE": str(2 * KV_GIB_PER_INSTANCE)}
    if run.deployment.omp_bind:
        extra["VLLM_CPU_OMP_THREADS_BIND"] = run.deployment.omp_bind
    cmd = ["taskset", "-c", "0,1", *_serve(model, port, vllm_args(max_model_len))]
    run.procs.append(_spawn(cmd, _env(**extra), run.log_dir / "plain.log"))
    run.url = f"http://{HOST}:{port}"
    run.instances = {"plain": run.url}


def _start_nixl(run: Running, model: str, max_model_len: int) -> None:
    """P on the last core: vLLM's NIXL worker pins its thread to the last core of the NUMA node (pd_bench:
    with P's compute on core 0 that thread fought D for core 1 and P ran ~10x slower)."""
    http_p, http_d, side_p, side_d, router = free_ports(5)
    for role, core, http, side in (("kv_producer", "1", http_p, side_p), ("kv_consumer", "0", http_d, side_d)):
        cfg = {"kv_connector": run.deployment.connector, "kv_role": role, "kv_buffer_device": "cpu",
               "kv_connector_extra_config": NIXL_EXTRA}
        env = _env(VLLM_CPU_OMP_THREADS_BIND=core, VLLM_CPU_KVCACHE_SPACE=str(KV_GIB_PER_INSTANCE),
                   VLLM_NIXL_SIDE_CHANNEL_HOST=HOST, VLLM_NIXL_SIDE_CHANNEL_PORT=str(side), **dict(run.deployment.env))
        cmd = ["taskset", "-c", core, *_serve(model, http, [*vllm_args(max_model_len),
                                                             "--kv-transfer-config", json.dumps(cfg)])]
        run.procs.append(_spawn(cmd, env, run.log_dir / f"{role}.log"))
    p_url, d_url = f"http://{HOST}:{http_p}", f"http://{HOST}:{http_d}"
    cmd = ["taskset", "-c", "0,1", sys.executable, "-m", "vllm_disagg.cli.main", "router", "--pd-protocol", "vllm",
           "--prefill", p_url, "--decode", d_url, "--port", str(router), "--read-timeout-s", "900",
           # every request P then D, as vLLM's own proxy routes them: no mixed pool for vLLM's P/D
           "--prefill-queue-s", "0", "--colocate-queue-s", "0"]
    run.procs.append(_spawn(cmd, _env(), run.log_dir / "router.log"))
    run.url = f"http://{HOST}:{router}"
    run.instances = {"prefill": p_url, "decode": d_url, "router": run.url}


def _start_ours(run: Running, model: str, max_model_len: int) -> None:
    dep, state = run.deployment, run.log_dir / "state.json"
    state.unlink(missing_ok=True)  # a stale one names a dead router, and `_wait_ready` reads it only once
    cmd = ["taskset", "-c", "0,1", sys.executable, "-m", "vllm_disagg.cli.main", "up", "--prefill", "1",
           "--decode", "1", "--transport", dep.transport, "--port", "0", "--state-file", str(state),
           "--log-dir", str(run.log_dir / "instances"), "--kv-cache-gib", str(KV_GIB_PER_INSTANCE),
           "--model", model, "--served-model-name", SERVED_NAME, *vllm_args(max_model_len)]
    if dep.nano:
        cmd += ["--disagg-num-nano-batches", "auto"]
    if dep.traced:
        cmd += ["--trace"]
    cmd += list(dep.up_args)
    run.procs.append(_spawn(cmd, _env(), run.log_dir / "up.log"))
    run.instances = {"state_file": str(state)}


def _wait_ready(run: Running, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p for p in run.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{run.deployment.name}: {dead[0].args[:6]} exited {dead[0].returncode}; "
                               f"logs in {run.log_dir}")
        if "state_file" in run.instances and Path(run.instances["state_file"]).exists():
            state = json.loads(Path(run.instances["state_file"]).read_text())
            run.url = state["endpoint"] if "endpoint" in state else state["router"]
            run.instances = {i["name"].rstrip("0123456789"): i["url"] for i in state["instances"]}
            run.instances["router"] = run.url
        if run.url and answers(f"{run.url}/v1/models") and all(answers(f"{u}/health") for u in run.instances.values()):
            return
        time.sleep(2)
    raise RuntimeError(f"{run.deployment.name} not ready after {timeout_s:.0f} s; logs in {run.log_dir}")


def placement(procs: list[subprocess.Popen]) -> dict:
    """Every process of the deployment: its name, the cores it may run on, and the distinct core sets of
    its threads (vLLM binds each OpenMP thread of the Worker to one core)."""
    out = {}
    for proc in process_trees(procs):
        with contextlib.suppress(psutil.Error):
            threads = {",".join(map(str, sorted(os.sched_getaffinity(t.id)))) for t in proc.threads()
                       if _alive_tid(t.id)}
            out[f"{proc.name()}[{proc.pid}]"] = {"cmd": " ".join(proc.cmdline()[:4])[:120],
                                                 "cores": ",".join(map(str, proc.cpu_affinity())),
                                                 "thread_cores": sorted(threads)}
    return out


def process_trees(procs: list[subprocess.Popen]) -> list:
    """Every live process the deployment's roots started (each root, then its descendants)."""
    tree = []
    for root in procs:
        try:
            tree += [psutil.Process(root.pid), *psutil.Process(root.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return tree


def _alive_tid(tid: int) -> bool:
    try:
        os.sched_getaffinity(tid)
        return True
    except OSError:
        return False


def stop(procs: list[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM each process group, SIGKILL what is left after `grace_s`."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
