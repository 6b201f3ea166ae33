# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up`: start a local Splitwise deployment (P/D pools + router) and serve until Ctrl-C.

    vllm-disagg up --prefill 1 --decode 1 --model smollm2-135m --port 8000 --dtype float32
    vllm-disagg up --prefill 0 --attention 2 --attention-partition head --dtype float32   # Lamina

`--attention K` starts K attention servers (`vllm-disagg attn-server`, one shared auth token) and runs
the model worker (the decode instance; with `--prefill 0`, one instance doing both phases) with remote
attention on them.

Arguments this command does not know (`--dtype`, `--max-model-len`, ...) go to every vLLM instance.
`--prefill 0 --decode 0` (or `--mixed N` alone) runs plain instances behind the router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import tempfile
from pathlib import Path

from vllm_disagg.launch.attention_sizing import size_for_args
from vllm_disagg.models import launch_model
from vllm_disagg.router.cli import (
    add_api_key_arg,
    add_failover_args,
    add_mixed_pool_args,
    add_tracing_args,
    api_keys,
    scheduler_config_from_args,
)

logger = logging.getLogger("vllm_disagg.launch")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "up", help="start P/D vLLM pools and the router on 127.0.0.1",
        description=__doc__.splitlines()[0], allow_abbrev=False,
        epilog="Unknown arguments are passed to every `vllm serve` instance.")
    parser.add_argument("--prefill", type=int, default=None,
                        help="prefill (P) instances (default 1; 0 with --attention: one instance does both phases)")
    parser.add_argument("--decode", type=int, default=1, help="decode (D) instances")
    parser.add_argument("--mixed", type=int, default=0, help="plain instances serving whole requests")
    parser.add_argument("--model", default="smollm2-135m", help="embedded model name or a local path")
    parser.add_argument("--port", type=int, default=8000, help="router port")
    parser.add_argument("--transport", choices=("tcp", "shm"), default="tcp", help="KV push backend")
    parser.add_argument("--cores-per-instance", type=int, default=1,
                        help="CPU cores per instance (VLLM_CPU_OMP_THREADS_BIND)")
    parser.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                        help="bind only vLLM's compute threads to the instance's cores, not its whole process tree")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per instance")
    parser.add_argument("--layerwise-threshold", type=int, default=None,
                        help="prompts with at least this many tokens are pushed layer by layer (P side)")
    parser.add_argument("--push-timeout-s", type=float, default=None,
                        help="D recomputes the prompt when a push stalls this long")
    add_mixed_pool_args(parser.add_argument_group("router mixed pool"))
    add_failover_args(parser.add_argument_group("router failover"))
    parser.add_argument("--restart-limit", type=int, default=5,
                        help="local backend: restarts of each instance that dies after it was healthy, over the "
                             "deployment's life (Ray: --max-restarts)")
    obs = parser.add_argument_group("observability")
    obs.add_argument("--trace", action="store_true",
                     help="trace requests across every process into <log-dir>/spans.jsonl (a local OTLP receiver; "
                          "read them with `vllm-disagg trace ID --state-file F`)")
    add_tracing_args(obs)
    add_api_key_arg(obs)
    obs.add_argument("--log-format", choices=("json", "text"), default="json",
                     help="format of every process's log in --log-dir (json: one object per line with request_id "
                          "and trace_id; text: the classic line plus those ids); read them with `vllm-disagg logs`")
    parser.add_argument("--access-log", action="store_true",
                        help="keep vLLM's per-request access log (off: /health polls would flood the logs)")
    parser.add_argument("--health-timeout-s", type=float, default=900.0,
                        help="how long to wait for the instances to become healthy")
    parser.add_argument("--log-dir", default=None, help="instance logs (default: a new temp dir)")
    parser.add_argument("--state-file", default=None,
                        help="write endpoint, instance URLs and pids here as JSON once healthy")
    g = parser.add_argument_group("Lamina attention servers (with --attention K)")
    g.add_argument("--attention-partition", choices=("auto", "head", "request"), default="auto",
                   help="split the KV across attention servers by KV head or by request (auto: head-wise when "
                        "K divides the model's KV heads, else request-wise, with prefix affinity)")
    g.add_argument("--pipeline", type=int, choices=(1, 2), default=1,
                   help="batches in flight: 2 = ping-pong on the NanoFlow nano-batch executor")
    g.add_argument("--attention-transport", choices=("shm", "tcp"), default="shm",
                   help="data path of the per-layer exchange (default shm: same host)")
    g.add_argument("--attention-kv-cache-gib", type=float, default=None,
                   help="KV memory of each attention server (default: sized from the model, --max-model-len and "
                        "the partition, at least the decode instance's --kv-cache-gib share, within free memory)")
    g.add_argument("--restart-attention", action="store_true",
                   help="restart a dead attention server too (same ports): its model worker waits for it "
                        "(--attention-replacement-wait-s) and rebuilds the lost KV")
    g.add_argument("--attention-replacement-wait-s", type=float, default=30.0,
                   help="with --restart-attention: how long the model worker waits for the restarted server")
    g.add_argument("--attention-kv-advertise", default=None, metavar="HOST:PORT,...",
                   help="with --prefill and --transport tcp: one address per attention server that prefill instances "
                        "connect to for its KV receiver, where it differs from where it listens (a proxy, a NAT)")
    g.add_argument("--send-q-early", action=argparse.BooleanOptionalAction, default=None,
                   help="send Q first and merge the partial softmax (default: the config's default)")
    from vllm_disagg.launch.ray.specs import add_ray_args

    add_ray_args(parser)  # --backend local|ray, --address, --attention, --ray-namespace
    _keep_unknown_args(parser)
    parser.set_defaults(func=run)
    return parser


def plan_from_args(args: argparse.Namespace, model_dir: str | None = None) -> list:
    """Instance specs of `up`; `--attention K` without `--prefill` turns the decode instance into a mixed
    one (both phases), which then becomes the model worker of the K attention servers. With `model_dir`,
    the servers' partition and KV size are resolved for that model (`attention_sizing.py`; raises
    `SizingError`, a ValueError, when they cannot hold one request of the max length)."""
    from vllm_disagg.launch.instances import (
        AttentionPlan,
        attach_attention,
        plan_instances,
        tensor_parallel_size,
    )

    resolve_prefill(args)
    num_attention = getattr(args, "attention", 0)
    num_decode, num_mixed = args.decode, args.mixed
    if num_attention and not args.prefill:
        num_decode, num_mixed = 0, num_mixed + num_decode
    reserved = {args.port}  # the router binds it only after the instances are up: never hand it out
    specs = plan_instances(args.prefill, num_decode, num_mixed, args.cores_per_instance, num_attention=num_attention,
                           tp_size=tensor_parallel_size(list(getattr(args, "vllm_args", []))), exclude=reserved)
    if args.layerwise_threshold is not None:
        for spec in specs:
            spec.kv_extra["layerwise_threshold_tokens"] = args.layerwise_threshold
    partition, kv_gib = args.attention_partition, args.attention_kv_cache_gib
    if num_attention and model_dir is not None:
        sizing = size_for_args(args, model_dir)
        partition, kv_gib = sizing.partition, sizing.kv_cache_gib
    advertise = getattr(args, "attention_kv_advertise", None)
    worker = attach_attention(specs, AttentionPlan(num_attention, partition, args.pipeline, args.attention_transport,
                                                   kv_gib, args.send_q_early, args.transport,
                                                   advertise.split(",") if advertise else None), reserved)
    if worker is not None and getattr(args, "restart_attention", False):
        worker.disagg_extra["remote_attention"]["replacement_wait_s"] = args.attention_replacement_wait_s
    return specs


def restart_policy(args: argparse.Namespace):
    """Which dead instances `up` restarts: P, D and mixed (and attention servers with --restart-attention)."""
    from vllm_disagg.launch.local import RestartPolicy

    roles = RestartPolicy().roles + (("attention",) if getattr(args, "restart_attention", False) else ())
    return RestartPolicy(max_restarts=getattr(args, "restart_limit", 5), roles=roles)


def _keep_unknown_args(parser: argparse.ArgumentParser) -> None:
    """Collect unknown arguments into `args.vllm_args` instead of failing (they belong to vLLM).

    The top-level parser rejects leftovers a subparser reports, so this subparser reports none."""
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extra = original(args, namespace)
        ns.vllm_args = [a for a in extra if a != "--"]
        return ns, []

    parser.parse_known_args = parse_known_args


def resolve_prefill(args: argparse.Namespace) -> None:
    """`--prefill` left out: 1 P instance, except with `--attention K` on the local backend, where one
    instance does both phases on the attention servers (the Ray backend keeps 1 P + D)."""
    if args.prefill is None:
        args.prefill = 0 if getattr(args, "attention", 0) else 1


def run(args: argparse.Namespace) -> int:
    if getattr(args, "backend", "local") == "ray":
        from vllm_disagg.launch.ray.up import run as run_ray

        return run_ray(args)
    try:
        return asyncio.run(_up(args))
    except KeyboardInterrupt:
        return 130


async def _up(args: argparse.Namespace) -> int:
    from vllm_disagg.launch.instances import LaunchError
    from vllm_disagg.launch.local import LocalCluster
    from vllm_disagg.router.server import Router, RouterServer

    model_dir = launch_model(args.model)
    try:
        specs = plan_from_args(args, model_dir)
    except (ValueError, OSError) as err:  # OSError: no config.json to size the attention servers from
        print(f"vllm-disagg up: {err}", flush=True)
        return 2
    _announce_attention(specs)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-disagg-up-"))
    vllm_args = list(getattr(args, "vllm_args", []))
    if not args.access_log:
        vllm_args.append("--disable-uvicorn-access-log")
    if getattr(args, "api_key", None):
        vllm_args += ["--api-key", *args.api_key]
    _structured_logs(args, specs, log_dir)
    collector = _start_tracing(args, specs, log_dir, vllm_args)
    cluster = LocalCluster(specs, model_dir, args.transport, vllm_args,
                           served_name=args.model, kv_cache_gib=args.kv_cache_gib, log_dir=log_dir,
                           bind_cores=getattr(args, "bind_cores", True), restart=restart_policy(args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = None
    try:
        print(f"vllm-disagg up: starting {len(specs)} instance(s), logs in {log_dir}", flush=True)
        attention = [s for s in specs if s.role == "attention"]
        if attention:  # the model worker connects to them while it loads
            cluster.start(attention)
            if not await _until(cluster.wait_healthy(args.health_timeout_s, attention), stop):
                return 130
        engines = [s for s in specs if s.role != "attention"]
        cluster.start(engines)
        if not await _until(cluster.wait_healthy(args.health_timeout_s, engines), stop):
            return 130
        router = Router(cluster.router_config(push_timeout_s=args.push_timeout_s,
                                              replay_attempts=args.replay_attempts,
                                              replay_wait_s=args.replay_wait_s,
                                              admission_wait_s=args.admission_wait_s,
                                              max_waiting=args.max_waiting,
                                              stall_timeout_s=args.stall_timeout_s,
                                              stall_factor=args.stall_factor, stall_min_s=args.stall_min_s,
                                              stall_release_s=args.stall_release_s,
                                              api_keys=api_keys(args)),
                        scheduler_config_from_args(args))
        server = RouterServer(router, "127.0.0.1", args.port)
        await server.start()
        _announce(cluster, server.url, args.state_file)
        if args.state_file:  # a restarted instance has a new pid: `status` and tests read it here
            cluster.on_restart = lambda _spec: _write_state(cluster, server.url, args.state_file)
        await _watch(cluster, stop)
        return 0
    except LaunchError as err:
        print(f"vllm-disagg up: {err}", flush=True)
        return 1
    finally:
        if server is not None:
            await server.stop()
        await asyncio.to_thread(cluster.stop)
        await asyncio.to_thread(_stop_tracing, collector)
        print("vllm-disagg up: stopped", flush=True)


def _announce_attention(specs: list) -> None:
    """One line on how the attention servers were set up (partition and KV size are resolved here)."""
    servers = [s for s in specs if s.role == "attention"]
    worker = next((s for s in specs if "remote_attention" in s.disagg_extra), None)
    if not servers or worker is None:
        return
    remote_attention, args = worker.disagg_extra["remote_attention"], servers[0].args
    size = args[args.index("--kv-cache-gib") + 1] if "--kv-cache-gib" in args else "default"
    print(f"vllm-disagg up: {len(servers)} attention server(s), partition {remote_attention['partition']}, "
          f"{size} GiB of KV each, pipeline {remote_attention['pipeline']}", flush=True)


async def _until(coro, stop: asyncio.Event) -> bool:
    """Run `coro` unless `stop` fires first; True when it finished."""
    task = asyncio.ensure_future(coro)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()
    return True


def _structured_logs(args: argparse.Namespace, specs: list, log_dir: Path) -> None:
    """Every process logs in `--log-format` into `log_dir`: the router (this process) into router.log
    (and the console), each instance through vLLM's `VLLM_LOGGING_CONFIG_PATH`."""
    from vllm_disagg.observe import logs

    log_dir.mkdir(parents=True, exist_ok=True)
    logs.configure(args.log_format, service="vllm-disagg-router", path=log_dir / "router.log")
    config = log_dir / "logging.json"
    config.write_text(json.dumps(logs.vllm_logging_config(args.log_format)))
    for spec in specs:
        spec.env.setdefault("VLLM_LOGGING_CONFIG_PATH", str(config))
        spec.env.setdefault("OTEL_SERVICE_NAME", f"vllm-disagg-{spec.name}")


def _start_tracing(args: argparse.Namespace, specs: list, log_dir: Path, vllm_args: list[str]):
    """`--trace` / `--otlp-traces-endpoint`: every process exports its spans (vLLM's own flag for the
    engines, the same flag for attention servers, the router here); `--trace` runs the receiver
    (`observe/collector.py`) writing <log-dir>/spans.jsonl. Returns that receiver, or None."""
    from vllm_disagg.observe import tracing

    endpoint, collector = args.otlp_traces_endpoint, None
    if args.trace and not endpoint:
        from vllm_disagg.observe.collector import SpanCollector

        collector = SpanCollector(log_dir / "spans.jsonl").start()
        endpoint = collector.grpc_endpoint
    if not endpoint:
        return None
    vllm_args += ["--otlp-traces-endpoint", endpoint]
    for spec in specs:
        if spec.role == "attention":
            spec.args = [*spec.args, "--otlp-traces-endpoint", endpoint]
    tracing.configure("vllm-disagg-router", endpoint, args.trace_sample_ratio)
    return collector


def _stop_tracing(collector) -> None:
    from vllm_disagg.observe import tracing

    tracing.shutdown()  # flushes the router's last spans
    if collector is not None:
        collector.stop()


def _write_state(cluster, url: str, state_file: str) -> dict:
    state = cluster.state(url)
    tmp = Path(state_file).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(state_file)  # readers never see half a file
    return state


def _announce(cluster, url: str, state_file: str | None) -> None:
    state = _write_state(cluster, url, state_file) if state_file else cluster.state(url)
    for inst in state["instances"]:
        print(f"  {inst['name']:<9} {inst['url']}  kv={inst['kv']}  cores={inst['cores']}", flush=True)
    print(f"vllm-disagg up: ready. OpenAI endpoint: {url}/v1  (model {state['model']!r}; Ctrl-C stops)",
          flush=True)


def _exit_reason(returncode: int | None) -> str:
    """`code 1`, or the signal's name for a crash (a SIGSEGV in a kernel leaves no log line of its own)."""
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"code {returncode}"


async def _watch(cluster, stop: asyncio.Event) -> None:
    """Serve until a signal; say once when an instance dies (the router's health checks route around
    it; the cluster's supervisor restarts it if it had been healthy, see launch/local.py)."""
    reported: set[tuple[str, int]] = set()  # per process: a restarted instance that dies again is reported again
    while not stop.is_set():
        for name in cluster.dead_instances():
            key = (name, cluster.procs[name].pid)
            if key not in reported:
                reported.add(key)
                logger.warning("instance %s exited (%s); the router routes around it until it is restarted",
                               name, _exit_reason(cluster.procs[name].returncode))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


# ------------------------------------------------------------- python -m vllm_disagg.launch.ray
def build_ray_parser() -> argparse.ArgumentParser:
    """`up`'s own parser (from launch/cli.py) plus the Ray flags, for `python -m vllm_disagg.launch.ray`."""
    top = argparse.ArgumentParser(prog="python -m vllm_disagg.launch.ray")
    sub = top.add_subparsers(dest="command")
    parser = add_parser(sub)
    if not any(a.dest == "backend" for a in parser._actions):
        from vllm_disagg.launch.ray.specs import add_ray_args

        add_ray_args(parser)
    return top


def ray_main(argv: list[str] | None = None) -> int:
    """`python -m vllm_disagg.launch.ray`: `up` with the Ray backend."""
    from vllm_disagg.launch.ray.up import run

    argv = sys.argv[1:] if argv is None else argv
    args = build_ray_parser().parse_args(["up", *argv])
    args.backend = "ray"
    return run(args)
