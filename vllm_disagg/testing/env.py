# SPDX-License-Identifier: Apache-2.0
"""The environment every vLLM process in tests and benchmarks needs on these boxes (README, "Environment")."""

from __future__ import annotations

import os

# Env every vLLM process in tests needs on these boxes (see README, "Environment").
TEST_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_test_env(in_process: bool = True) -> None:
    """Set TEST_ENV (without overriding what the caller set); in-process engines start in ~5 s."""
    for key, value in TEST_ENV.items():
        os.environ.setdefault(key, value)
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
