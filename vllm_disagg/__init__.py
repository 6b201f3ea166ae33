# SPDX-License-Identifier: Apache-2.0
"""vllm-disagg: a vLLM plugin for disaggregated and nano-batched serving.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process (API
server, engine core, workers). It is idempotent and inert unless configured: it only installs
hooks that check `additional_config["disagg"]` before doing anything.
"""

from __future__ import annotations

import logging

__all__ = ["register", "__version__"]
__version__ = "0.1.0"

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Install the plugin's hooks into vLLM; safe to call any number of times."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_disagg.patches import apply_all

    apply_all()
