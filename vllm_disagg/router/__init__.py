# SPDX-License-Identifier: Apache-2.0
"""Splitwise's cluster-level front end: an OpenAI-compatible router over prefill/decode/mixed pools.

Reading path: README.md. Public names load lazily so `import vllm_disagg.router` stays cheap.
"""

from __future__ import annotations

import sys

__all__ = ["Router", "RouterServer", "RouterConfig", "run_router", "register"]

_LAZY = {
    "Router": "vllm_disagg.router.server",
    "RouterServer": "vllm_disagg.router.server",
    "run_router": "vllm_disagg.router.server",
    "RouterConfig": "vllm_disagg.router.config",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


def register() -> None:
    """Make `vllm launch disagg-proxy` discoverable; idempotent, and inert outside vLLM's CLI process."""
    if "vllm.entrypoints.cli.launch" in sys.modules:
        import vllm_disagg.router.vllm_launch  # noqa: F401  (defining the subclass registers it)
