# SPDX-License-Identifier: Apache-2.0
"""The vLLM version the patches were written against, the guard they share, and the refusal a
feature gives when a patch it needs did not apply (`PatchNotApplied`, one line)."""

from __future__ import annotations

import logging

TARGET_VLLM = "0.32"
logger = logging.getLogger(__name__)

_skipped: dict[str, str] = {}
"""patch name -> why it did not apply (for the refusal line)."""


class PatchNotApplied(RuntimeError):
    """A feature needs a patch that did not apply in this process; the message is one line."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def version_matches(found: str) -> bool:
    return found.split("+")[0].startswith(TARGET_VLLM + ".") or found == TARGET_VLLM


def version_ok(patch: str) -> bool:
    """True when the installed vLLM is the one `patch` was written for; warns otherwise."""
    found = vllm_version()
    if version_matches(found):
        _skipped.pop(patch, None)
        return True
    mark_skipped(patch, f"it targets vLLM {TARGET_VLLM}.x, this is vLLM {found}")
    logger.warning("vllm-disagg: patch %s targets vLLM %s.x but found %s; not applied", patch, TARGET_VLLM, found)
    return False


def mark_skipped(patch: str, reason: str) -> None:
    _skipped[patch] = reason


def skip_reason(patch: str) -> str | None:
    return _skipped.get(patch)


def install(owner: type, attr: str, replacement) -> None:
    """Save `owner.attr` once as `_vllm_disagg_original_<attr>`, then put `replacement` in its place.

    Idempotent: a second call (or one after `importlib.reload`) leaves the first install alone."""
    saved = f"_vllm_disagg_original_{attr}"
    if hasattr(owner, saved):
        return
    setattr(owner, saved, getattr(owner, attr))
    setattr(owner, attr, replacement)
