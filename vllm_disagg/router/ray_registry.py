# SPDX-License-Identifier: Apache-2.0
"""The Ray registry of a deployment: its instance actors' names and endpoints in GCS.

`vllm-disagg up --backend ray` (launch/ray.py) names each instance actor `ACTOR_PREFIX + name` in a
Ray namespace and publishes the router's URL under `ROUTER_KEY`; the router's discovery
(`discovery.RayActorSource`) and `vllm-disagg status` read them back. Needs a connected Ray driver.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAMESPACE = "vllm-disagg"
ACTOR_PREFIX = "vllm-disagg:"
ROUTER_KEY = b"vllm-disagg:router"
"""GCS internal-KV key holding the router's URL (read by `vllm-disagg status`)."""


def instance_names(namespace: str) -> list[str]:
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"] for n in names
                  if n.get("namespace") == namespace and n["name"].startswith(ACTOR_PREFIX))


def instance_endpoints(namespace: str, timeout_s: float = 5.0) -> list[dict]:
    """Endpoint of every named instance actor GCS knows (alive or restarting; a permanently dead actor
    loses its name). One that does not answer in time or fails the call (restarting, busy) gets
    `{"name", "up": None, "error"}`: unknown, not gone."""
    import ray

    handles, out = {}, []
    for name in instance_names(namespace):
        try:
            handles[name] = ray.get_actor(name, namespace=namespace)
        except ValueError as err:  # gone between listing and lookup
            logger.debug("instance %s vanished: %s", name, err)
    refs = {h.endpoint.remote(): name for name, h in handles.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in ready:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError as err:
            out.append({"name": refs[ref], "up": None, "error": type(err).__name__})
    out += [{"name": refs[ref], "up": None, "error": "no answer"} for ref in pending]
    return sorted(out, key=lambda e: e["name"])
