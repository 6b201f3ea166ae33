# SPDX-License-Identifier: Apache-2.0
"""Narrow, version-guarded changes to vLLM internals (installed as `vllm_disagg.patches`).

The inventory, with the reason and removal plan for each, is `patches/README.md`. Each patch
module exposes `apply(hooks) -> bool`: idempotent, a no-op unless the plugin is configured, and
skipped with a WARNING naming both versions on another vLLM. `apply_all()` returns what applied;
a feature names the patches it needs with `require(feature, *names)`, which refuses with one line
(`PatchNotApplied`) naming the patch and both vLLM versions when one did not apply: fail closed.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from vllm_disagg.patches.compat import TARGET_VLLM, PatchNotApplied, skip_reason, vllm_version

__all__ = ["PATCHES", "PatchHooks", "PatchNotApplied", "apply_all", "applied", "is_applied", "require", "TARGET_VLLM"]

logger = logging.getLogger(__name__)

# One module per upstream symbol; applied in this order by `vllm_disagg.register()`.
PATCHES = [
    "cli_plugin_flag",  # P2
    "engine_config_wiring",  # P3
    "scheduler_fatal_kv_failure",  # P4
    "cpu_worker_runner",  # P5
    "runner_class_swap",  # P6
    "worker_ubatching",  # P7
    "attn_backend_cache",  # P8
    "couplings",  # private-method overrides, checked against one vLLM version
]
ON_DEMAND = ["vllm_dist_alias"]  # P1's code half: applied by `vllm-disagg serve` for its own process
DEFERRED = {
    "scheduler_fatal_kv_failure": "vllm.v1.core.sched.scheduler",
    "cpu_worker_runner": "vllm.v1.worker.cpu_worker",
    "runner_class_swap": "vllm.v1.worker.cpu_model_runner",
}
"""Patches whose upstream module only an engine process imports: applied the moment that module is
imported (a post-import hook), not by importing it in every process. Importing them eagerly cost
each `vllm serve` API server ~2 s it never used. `require` still applies one that has not run."""


@dataclass(frozen=True)
class PatchHooks:
    """What the plugin plugs into the patches (the patches never import the features)."""

    add_flags: Callable | None = None  # P2: argparse parser -> None
    merge_flags: Callable | None = None  # P2: argparse namespace -> None, folds --disagg-* in
    wire_engine_args: Callable | None = None  # P3: EngineArgs -> None, fills connector/worker


_applied: dict[str, bool] = {}


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def apply_one(name: str, hooks: PatchHooks | None = None) -> bool:
    try:
        ok = bool(_module(name).apply(hooks or PatchHooks()))
    except Exception:  # noqa: BLE001 - one broken patch must not hide the others
        logger.exception("vllm-disagg: patch %s failed to apply", name)
        ok = False
    _applied[name] = ok
    return ok


def apply_all(hooks: PatchHooks | None = None) -> dict[str, bool]:
    """Apply every patch, a `DEFERRED` one once its upstream module is imported (at once if it is);
    returns what applied so far, {name: applied}. A failure is logged per patch, never grouped."""
    import wrapt

    for name in PATCHES:
        if name in DEFERRED:
            _applied.pop(name, None)  # decided again when its module is (or already was) imported
            wrapt.register_post_import_hook(lambda _module, name=name: apply_one(name, hooks), DEFERRED[name])
        else:
            apply_one(name, hooks)
    return applied()


def applied() -> dict[str, bool]:
    """What applied in this process so far ({} before `apply_all`)."""
    return dict(_applied)


def is_applied(name: str) -> bool:
    """Whether `name` applied in this process; a patch not tried yet is tried now, without hooks."""
    return _applied[name] if name in _applied else apply_one(name)


def require(feature: str, *names: str) -> None:
    """Refuse to start `feature` unless every patch in `names` applied in this process.

    A patch not tried yet (a process where `register()` did not run) is tried now, without hooks."""
    for name in names:
        if name not in PATCHES and name not in ON_DEMAND:
            raise ValueError(f"unknown patch {name!r}; known: {', '.join(PATCHES + ON_DEMAND)}")
        if not is_applied(name):
            why = skip_reason(name) or f"it targets vLLM {TARGET_VLLM}.x, this is vLLM {_found()} (see the log)"
            raise PatchNotApplied(f"vllm-disagg: {feature} needs patch {name} ({_module(name).UPSTREAM}), "
                                  f"which did not apply: {why}")


def _found() -> str:
    try:
        return vllm_version()
    except ImportError:
        return "not installed"
