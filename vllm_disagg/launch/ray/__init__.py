# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --backend ray`: the P/D (and attention) pools as Ray actors across a Ray cluster.

    vllm-disagg up --backend ray --address auto --prefill 2 --decode 2 --model /shared/model
    python -m vllm_disagg.launch.ray --address ray://head:10001 --prefill 1 --decode 1   # same

`specs.py` (flags, one spec per instance, the server command), `actor.py` (the instance actor),
`cluster.py` (placement groups and actors), `up.py` (the `up` body). Placement, discovery and
failures: launch/README.md, "Ray backend". Names load lazily, so the CLI parser imports no Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "specs": ("POOLS", "REPLACEMENT_WAIT_S", "ActorSpec", "add_ray_args", "plan_actor_specs",
              "remote_attention_settings", "server_command"),
    "actor": ("InstanceServer", "count_start", "free_ports", "instance_actor_class", "node_ip", "starts_key"),
    "cluster": ("RayCluster",),
    "up": ("run",),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}
_REGISTRY = ("ACTOR_PREFIX", "NAMESPACE", "ROUTER_KEY", "instance_endpoints", "instance_names")
_CLI = {"build_parser": "build_ray_parser", "main": "ray_main"}  # kept: they lived here

__all__ = sorted([*_WHERE, *_REGISTRY, *_CLI])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    if name in _REGISTRY:
        return getattr(importlib.import_module("vllm_disagg.router.ray_registry"), name)
    if name in _CLI:
        return getattr(importlib.import_module("vllm_disagg.launch.cli"), _CLI[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
