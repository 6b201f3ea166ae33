# SPDX-License-Identifier: Apache-2.0
"""`init_logger`: vLLM's logger where vLLM is installed, plain `logging` where it is not.

Modules that run without vLLM (the attention server, its client and the transports on a GPU
machine that has torch but no vLLM wheel: `docs/gpu.md`) take their logger from here, so they
import there; with vLLM installed they log exactly as through `vllm.logger.init_logger`.
"""

from __future__ import annotations

import logging

__all__ = ["init_logger"]


def init_logger(name: str) -> logging.Logger:
    try:
        from vllm.logger import init_logger as vllm_init_logger
    except ImportError:
        return logging.getLogger(name)
    return vllm_init_logger(name)
