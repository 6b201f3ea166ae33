# SPDX-License-Identifier: Apache-2.0
"""The placement groups and instance actors of one Ray deployment: one group per pool, one
bundle per instance asking for the pool's custom resource, plus CPUs/GPUs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from dataclasses import asdict

from vllm_disagg.launch.ray.actor import instance_actor_class, starts_key
from vllm_disagg.launch.ray.specs import ActorSpec
from vllm_disagg.router.ray_registry import ACTOR_PREFIX, ROUTER_KEY, instance_endpoints, instance_names

logger = logging.getLogger("vllm_disagg.launch.ray")


class RayCluster:
    """The placement groups and instance actors of one deployment."""

    def __init__(self, specs: list[ActorSpec], args: argparse.Namespace) -> None:
        self.specs = specs
        self.args = args
        self.namespace = args.ray_namespace
        self.groups: dict[str, object] = {}
        self.actors: dict[str, object] = {}

    def bundle(self, role: str) -> dict[str, float]:
        b = {"CPU": self.args.cpus_per_instance, "mixed" if role == "mixed" else role: 1}
        if role == "mixed":  # mixed instances go on nodes of either phase: no custom resource
            b.pop("mixed")
        if self.args.gpus_per_instance and role != "attention":
            b["GPU"] = self.args.gpus_per_instance
        if self.args.accelerator_type and role != "attention":
            b[f"accelerator_type:{self.args.accelerator_type}"] = 0.001
        return b

    def reserve(self, timeout_s: float) -> None:
        """One placement group per pool, one bundle per instance; waits until all are placed."""
        import ray
        from ray.util.placement_group import placement_group

        existing = instance_names(self.namespace)
        if existing:
            raise RuntimeError(f"Ray namespace {self.namespace!r} already has instances {existing}; "
                               "stop that deployment or pass --ray-namespace")
        by_role: dict[str, list[ActorSpec]] = {}
        for spec in self.specs:
            by_role.setdefault(spec.role, []).append(spec)
        for role, specs in by_role.items():
            pg = placement_group([self.bundle(role)] * len(specs), strategy=self.args.placement_strategy,
                                 name=f"{ACTOR_PREFIX}{role}")
            self.groups[role] = pg
        for role, pg in self.groups.items():
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"placement group for {role} not ready after {timeout_s:.0f} s: does the "
                                   f"cluster have {len(by_role[role])} x {self.bundle(role)}?") from None

    def launch(self, specs: list[ActorSpec]) -> None:
        """Start the instance actors of `specs`, each in its pool's bundle (same index as in the pool)."""
        from ray.experimental import internal_kv
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = instance_actor_class(self.args.max_restarts)
        for spec in specs:
            internal_kv._internal_kv_del(starts_key(self.namespace, spec.name))  # a new deployment: count from 1
            strategy = PlacementGroupSchedulingStrategy(self.groups[spec.role],
                                                       placement_group_bundle_index=spec.index)
            self.actors[spec.name] = cls.options(
                name=spec.name, namespace=self.namespace, num_cpus=0,
                scheduling_strategy=strategy).remote(asdict(spec))
            logger.info("started actor %s in placement group %s, bundle %d", spec.name, spec.role, spec.index)

    async def wait_up(self, timeout_s: float, names: list[str] | None = None) -> list[dict]:
        """Until every (named) instance answered /health once; fails fast if one keeps dying."""
        names = names or [s.name for s in self.specs]
        deadline = time.monotonic() + timeout_s
        while True:
            eps = {e["name"]: e for e in await asyncio.to_thread(instance_endpoints, self.namespace)}
            down = [n for n in names if not eps.get(n, {}).get("up")]
            if not down:
                return [eps[n] for n in names]
            dead = [n for n in down if n not in eps]  # no name in GCS: out of restarts
            if dead or time.monotonic() > deadline:
                why = "died for good" if dead else f"not up after {timeout_s:.0f} s"
                raise RuntimeError(f"instances {dead or down} {why}:\n{self.log_tails(dead or down)}")
            await asyncio.sleep(1.0)

    def log_tails(self, names: list[str]) -> str:
        import ray

        out = []
        for name in names:
            try:
                out.append(f"--- {name}\n" + ray.get(self.actors[name].log_tail.remote(), timeout=10))
            except Exception as err:  # dead actor: nothing to read
                out.append(f"--- {name}: no log ({type(err).__name__})")
        return "\n".join(out)

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        refs = []
        for h in self.actors.values():
            with contextlib.suppress(Exception):
                refs.append(h.stop.remote())
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for h in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        for pg in self.groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        with contextlib.suppress(Exception):
            from ray.experimental import internal_kv

            internal_kv._internal_kv_del(ROUTER_KEY)
