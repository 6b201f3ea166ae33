# SPDX-License-Identifier: Apache-2.0
"""The vLLM version the patches were written against, and the guard they share."""

from __future__ import annotations

import logging

TARGET_VLLM = "0.32"
logger = logging.getLogger(__name__)


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_ok(patch: str) -> bool:
    """True when the installed vLLM is the one `patch` was written for; warns otherwise."""
    found = vllm_version()
    if found.split("+")[0].startswith(TARGET_VLLM + ".") or found == TARGET_VLLM:
        return True
    logger.warning("vllm-disagg: patch %s targets vLLM %s.x but found %s; not applied", patch, TARGET_VLLM, found)
    return False


def install(owner: type, attr: str, replacement) -> None:
    """Save `owner.attr` once as `_vllm_disagg_original_<attr>`, then put `replacement` in its place.

    Idempotent: a second call (or one after `importlib.reload`) leaves the first install alone."""
    saved = f"_vllm_disagg_original_{attr}"
    if hasattr(owner, saved):
        return
    setattr(owner, saved, getattr(owner, attr))
    setattr(owner, attr, replacement)
