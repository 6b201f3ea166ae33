# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Engines are expensive here (5-30 s): share them with module-scoped fixtures."""

from __future__ import annotations

import pytest

from vllm_disagg.testing import apply_test_env, make_tiny_llama

apply_test_env(in_process=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Llama with seeded random weights that make its output depend on the context
    (`tiny_llm_kwargs` loads them; vLLM's dummy weights would hide stale or misplaced KV)."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), weights=True))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded SmolLM2-135M-Instruct checkpoint (pulled once into the cache, ~35 s cold)."""
    from vllm_disagg.models import pull

    return str(pull("smollm2-135m"))
