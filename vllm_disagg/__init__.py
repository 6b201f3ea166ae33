# SPDX-License-Identifier: Apache-2.0
"""vllm-disagg: a vLLM plugin for disaggregated and nano-batched serving.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process (API
server, engine core, workers). It is idempotent and inert unless configured: it only installs
hooks that check `additional_config["disagg"]` before doing anything. It sits above every layer
(docs/design/layers.md), so it imports the package only inside functions: importing any
`vllm_disagg.*` module runs this file.
"""

from __future__ import annotations

import importlib
import logging

__all__ = ["register", "__version__"]
__version__ = "0.1.0"

logger = logging.getLogger(__name__)
_registered = False

# Per-concept registrations, each idempotent and inert unless configured:
# - attention: CPU_ATTN / CUSTOM backend overrides that stay stock CPU attention until
#   additional_config["disagg"]["remote_attention"] is set;
# - router: makes `vllm launch disagg-proxy` discoverable (CLI process only);
# - kv: nothing today (vLLM imports the connector via kv_connector_module_path).
CONCEPT_REGISTRARS = ["vllm_disagg.attention", "vllm_disagg.router", "vllm_disagg.kv"]


def register() -> dict[str, bool]:
    """Install the plugin's hooks into vLLM; safe to call any number of times. Returns which
    patches applied so far (the engine-only ones apply when vLLM imports their module,
    `patches.DEFERRED`): a feature that needs one that did not refuses to start (`patches.require`)."""
    global _registered
    from vllm_disagg.patches import applied, apply_all

    if _registered:
        return applied()
    _registered = True
    _share_vllm_logging()
    results = apply_all(patch_hooks())
    _pass_cost_models()
    for name in CONCEPT_REGISTRARS:
        try:
            importlib.import_module(name).register()
        except Exception:  # noqa: BLE001 - one concept failing must not take vLLM down
            logger.exception("vllm-disagg: registering %s failed; that feature is unavailable", name)
    return results


def _pass_cost_models() -> None:
    """The nano-batch runner logs its throughput against the planner's optimum (Eq. 9); nanoflow
    sits below the planner (docs/design/layers.md), so the plugin root passes it in."""
    try:
        from vllm_disagg.nanoflow.throughput import set_optimum_model
        from vllm_disagg.planner.nanoflow import optimal_tokens_per_s
    except ImportError as err:  # a planning-only install has no torch
        logger.debug("vllm-disagg: no nano-batch throughput log here: %s", err)
        return
    set_optimum_model(optimal_tokens_per_s)


def patch_hooks():
    """What the patches call into: the `--disagg-*` flags (P2) and the engine wiring (P3)."""
    from vllm_disagg.cli.flags import add_disagg_flags, merge_flags_into_namespace
    from vllm_disagg.patches import PatchHooks
    from vllm_disagg.wiring import wire_engine_args

    return PatchHooks(add_flags=add_disagg_flags, merge_flags=merge_flags_into_namespace,
                      wire_engine_args=wire_engine_args)


def _share_vllm_logging() -> None:
    """Route `vllm_disagg.*` records through vLLM's logger (vLLM only configures `vllm.*`), so our
    lifecycle INFO lines appear in vLLM's log with its format and level, whenever it configures them."""
    if logger.parent is logging.root:
        logger.parent = logging.getLogger("vllm")
