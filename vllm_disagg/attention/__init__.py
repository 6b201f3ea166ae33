# SPDX-License-Identifier: Apache-2.0
"""Lamina: remote attention workers that own the KV cache (see README.md for the reading path).

`register()` installs the attention-backend override in every vLLM process. It is idempotent,
imports nothing heavy, and is inert unless `additional_config["disagg"]["remote_attention"]` is
set: the override resolves to the stock CPU backend otherwise (`backend.SelectedBackend`).
"""

from __future__ import annotations

__all__ = ["register", "BACKEND_PATH"]

BACKEND_PATH = "vllm_disagg.attention.backend.SelectedBackend"
_registered = False


def register() -> None:
    """Point CPU_ATTN (CPU) and CUSTOM (GPU) at the remote backend selector; safe to repeat."""
    global _registered
    if _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    if not AttentionBackendEnum.CUSTOM.is_overridden():  # leave someone else's CUSTOM alone
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _registered = True
