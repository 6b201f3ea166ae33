# SPDX-License-Identifier: Apache-2.0
"""What each instance actor of a Ray deployment runs: the `up` flags of the Ray backend, one
`ActorSpec` per instance (attention workers first) and the real server command it starts."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vllm_disagg.envs import VLLM_DISAGG_AUTH_TOKEN
from vllm_disagg.launch.attention_sizing import size_for_args
from vllm_disagg.launch.instances import CONNECTOR, LIVE_MIDDLEWARE, ONE_KV_GROUP_FLAG, tensor_parallel_size
from vllm_disagg.router.ray_registry import ACTOR_PREFIX, NAMESPACE

POOLS = ("prefill", "decode", "mixed", "attention")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """Flags `up` needs for `--backend ray` (shared by `launch/cli.py` and this module's main)."""
    g = parser.add_argument_group("ray backend")
    g.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: processes on this host; ray: actors placed on a Ray cluster")
    g.add_argument("--address", default="auto", help="Ray cluster: auto, HOST:PORT or ray://HOST:10001")
    g.add_argument("--attention", type=int, default=0, help="Lamina attention workers (decode uses them)")
    g.add_argument("--ray-namespace", default=NAMESPACE, help="Ray namespace of the instance actors")
    g.add_argument("--router-host", default="127.0.0.1", help="interface of the router (0.0.0.0: all)")
    g.add_argument("--cpus-per-instance", type=float, default=1.0, help="Ray CPUs reserved per instance")
    g.add_argument("--gpus-per-instance", type=float, default=0.0, help="Ray GPUs reserved per instance")
    g.add_argument("--accelerator-type", default=None, help="Ray accelerator_type for P/D bundles (e.g. H100)")
    g.add_argument("--placement-strategy", default="SPREAD", choices=("PACK", "SPREAD", "STRICT_SPREAD"),
                   help="how a pool's bundles spread over nodes")
    g.add_argument("--max-restarts", type=int, default=3, help="Ray restarts a dead instance actor this often")
    g.add_argument("--attention-port", type=int, default=8300,
                   help="HTTP port of attention worker i is this + i (fixed: decode lists them)")


@dataclass
class ActorSpec:
    """What one instance actor runs; plain data so Ray can ship it to the node."""

    role: str
    index: int
    model: str
    served_name: str | None = None
    transport: str = "tcp"
    vllm_args: list[str] = field(default_factory=list)
    kv_cache_gib: float = 1.0
    cores_per_instance: int = 1
    attention_servers: list[str] = field(default_factory=list)
    http_port: int = 0
    """0: pick a free port at every (re)start; attention workers use a fixed one."""
    kv_transport: str | None = None
    """Attention worker: accept prefill KV pushes on this transport (the prefill instances' kv.transport);
    None when the deployment has no prefill instance."""
    remote_attention: dict = field(default_factory=dict)
    """Decode/mixed model worker: `additional_config["disagg"]["remote_attention"]` besides the servers
    (partition, pipeline, send_q_early), as `up --attention K` builds it on the local backend."""
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    """Parent of the instance's log folder on its node (default: the node's temp dir)."""

    @property
    def name(self) -> str:
        return f"{ACTOR_PREFIX}{self.role}{self.index}"


def plan_actor_specs(args: argparse.Namespace, model: str) -> list[ActorSpec]:
    """One spec per instance, attention workers first (decode needs their addresses)."""
    if args.prefill is None:  # left out: one P instance (see launch.cli.resolve_prefill for local)
        args.prefill = 1
    if args.prefill and not args.decode:
        raise ValueError("--prefill needs at least one --decode instance to push to")
    mixed = args.mixed if (args.prefill or args.decode or args.mixed) else 1
    if tensor_parallel_size(list(getattr(args, "vllm_args", []))) > 1:
        raise ValueError("--tensor-parallel-size > 1 runs with --backend local only: a Ray actor gets one "
                         "KV port and one core slice, not one per TP rank")
    if getattr(args, "attention_kv_advertise", None):
        raise ValueError("--attention-kv-advertise runs with --backend local only: Ray picks each attention "
                         "worker's node and port when it places it")
    token = os.environ.get(VLLM_DISAGG_AUTH_TOKEN) or secrets.token_hex(16)
    common = dict(model=model, served_name=args.model, transport=args.transport,
                  vllm_args=list(getattr(args, "vllm_args", [])), kv_cache_gib=args.kv_cache_gib,
                  cores_per_instance=args.cores_per_instance, env={VLLM_DISAGG_AUTH_TOKEN: token},
                  log_dir=getattr(args, "log_dir", None))
    if not getattr(args, "access_log", False):
        common["vllm_args"].append("--disable-uvicorn-access-log")
    if args.attention and args.decode + mixed != 1:
        raise ValueError("--attention K serves exactly one model worker: use one --decode (or --prefill 0 "
                         f"--decode 0 for one mixed instance), got {args.decode} decode + {mixed} mixed")
    attention = {**common, "kv_cache_gib": _attention_kv_gib(args, model),
                 "kv_transport": args.transport if args.prefill else None}
    specs = [ActorSpec("attention", i, http_port=args.attention_port + i, **attention)
             for i in range(args.attention)]
    for role, num in (("prefill", args.prefill), ("decode", args.decode), ("mixed", mixed)):
        specs += [ActorSpec(role, i, **common) for i in range(num)]
    if args.attention:
        for s in specs:
            if s.role in ("decode", "mixed"):
                s.remote_attention = remote_attention_settings(args)
            elif s.role == "prefill":  # one KV cache group, as its decode model worker
                s.vllm_args = [*s.vllm_args, ONE_KV_GROUP_FLAG]
    return specs


def _attention_kv_gib(args: argparse.Namespace, model: str) -> float:
    """Each attention worker's KV size, sized for the model as on the local backend (and its partition
    resolved into `args`); a model path without config.json here (on other nodes) keeps the flags."""
    if not args.attention or not (Path(model) / "config.json").exists():
        return getattr(args, "attention_kv_cache_gib", None) or args.kv_cache_gib
    sizing = size_for_args(args, model)
    args.attention_partition = sizing.partition
    return sizing.kv_cache_gib


REPLACEMENT_WAIT_S = 180.0
"""Head-wise: how long a model worker waits for Ray to restart a lost attention worker (same bundle,
same fixed port) before giving up; one survivor alone would not hold the scheduler's blocks."""


def remote_attention_settings(args: argparse.Namespace) -> dict:
    """The model worker's remote_attention settings from `up`'s flags (local: launch.local.attach_attention).
    The per-layer exchange is tcp here: Ray places the servers on other nodes."""
    remote_attention = {"transport": "tcp", "partition": getattr(args, "attention_partition", "auto"),
                        "pipeline": getattr(args, "pipeline", 1)}
    if remote_attention["partition"] != "request":  # request-wise goes on at once with the survivors
        remote_attention["replacement_wait_s"] = REPLACEMENT_WAIT_S
    if getattr(args, "send_q_early", None) is not None:
        remote_attention["send_q_early"] = args.send_q_early
    return remote_attention


def server_command(spec: ActorSpec, host: str, http_port: int, kv_port: int | None) -> list[str]:
    """The real command of an instance: `vllm serve ... --plugin disagg` or `vllm-disagg attn-server`."""
    exe_dir = Path(sys.executable).parent
    if spec.role == "attention":
        cmd = [str(exe_dir / "vllm-disagg"), "attn-server", "--transport", "tcp", "--host", host,
               "--http-port", str(http_port), "--kv-cache-gib", str(spec.kv_cache_gib)]
        if spec.kv_transport:  # prefill instances push their KV straight into this server's blocks
            cmd += ["--kv-transport", spec.kv_transport]
        return cmd
    cmd = [str(exe_dir / "vllm"), "serve", spec.model, "--host", host, "--port", str(http_port),
           "--middleware", LIVE_MIDDLEWARE]  # /live (the router's hang detection) and the body cap, as local
    if spec.served_name and "--served-model-name" not in spec.vllm_args:
        cmd += ["--served-model-name", spec.served_name]
    if spec.role in ("prefill", "decode"):
        cmd += ["--plugin", "disagg", "--disagg-role", spec.role, "--disagg-kv-port", str(kv_port),
                "--disagg-transport", spec.transport]
    if spec.attention_servers and spec.role in ("decode", "mixed"):
        if spec.role == "mixed":  # the model worker without P/D: the connector restores retained KV
            cmd += ["--plugin", "disagg",
                    "--kv-transfer-config", json.dumps({**CONNECTOR, "kv_role": "kv_consumer"})]
        remote_attention = spec.remote_attention or {"transport": "tcp"}
        disagg = {"remote_attention": remote_attention}
        if remote_attention.get("pipeline", 1) > 1:  # n=2 ping-pong = the NanoFlow nano-batch executor
            disagg["nanoflow"] = {"num_nano_batches": remote_attention["pipeline"]}
        cmd += ["--disagg-attention-servers", ",".join(spec.attention_servers),
                "--additional-config", json.dumps({"disagg": disagg})]
    return cmd + list(spec.vllm_args)
