# SPDX-License-Identifier: Apache-2.0
"""Environment switches of the plugin, with typed getters. Config stays the way to turn features on."""

from __future__ import annotations

import os
from pathlib import Path

VLLM_DISAGG_CACHE = "VLLM_DISAGG_CACHE"
VLLM_DISAGG_AUTH_TOKEN = "VLLM_DISAGG_AUTH_TOKEN"


def cache_dir() -> Path:
    """Where pulled models and plans live (default ~/.cache/vllm-disagg)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-disagg"
    return Path(os.environ.get(VLLM_DISAGG_CACHE, default))


def auth_token() -> str | None:
    return os.environ.get(VLLM_DISAGG_AUTH_TOKEN) or None
