# SPDX-License-Identifier: Apache-2.0
"""Narrow, version-guarded changes to vLLM internals (installed as `vllm_disagg.patches`).

The inventory, with the reason and removal plan for each, is `patches/README.md`.
Each patch module exposes `apply() -> bool`; it is idempotent and a no-op unless the plugin is
configured. A version mismatch skips the patch with a WARNING naming both versions.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

# One module per upstream symbol; applied in this order by `register()`.
PATCH_MODULES = [
    "vllm_disagg.patches.cli_plugin_flag",
    "vllm_disagg.patches.engine_config_wiring",
    "vllm_disagg.patches.scheduler_fatal_kv_failure",
]


def apply_all() -> dict[str, bool]:
    """Apply every patch; returns {module: applied}. A failure is logged per patch, never grouped."""
    results = {}
    for name in PATCH_MODULES:
        try:
            results[name] = bool(importlib.import_module(name).apply())
        except Exception:  # noqa: BLE001 - one broken patch must not hide the others
            logger.exception("vllm-disagg: patch %s failed to apply", name)
            results[name] = False
    return results
