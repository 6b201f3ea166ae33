# SPDX-License-Identifier: Apache-2.0
"""What tests, benchmarks and the chaos tool share, kept apart from the runtime (nothing under
`vllm_disagg/` outside this package imports it): tiny seeded models, the test environment,
deployments started as users start them, local attention servers (`attention.py`) and transport
peers in child processes (`peers.py`)."""

from vllm_disagg.testing.env import TEST_ENV, apply_test_env
from vllm_disagg.testing.families import FAMILIES, Family, make_tiny_model
from vllm_disagg.testing.models import (
    SMOLLM2_VOCAB,
    TINY_LLAMA_CONFIG,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    TokenizerUnavailable,
    load_format,
    make_tiny_llama,
    random_llama_weights,
    smollm2_tokenizer_dir,
    tiny_llama_with_tokenizer,
    tiny_llm_kwargs,
    token_id_lists,
    token_prompts,
)
from vllm_disagg.testing.up import RunningUp, group_alive, running_up, sse_events

__all__ = [
    "FAMILIES", "SMOLLM2_VOCAB", "TEST_ENV", "Family", "make_tiny_model", "TINY_LLAMA_CONFIG", "TOKENIZER_FILES", "WEIGHTS_FILE", "RunningUp",
    "TokenizerUnavailable", "apply_test_env", "group_alive", "load_format", "make_tiny_llama",
    "random_llama_weights", "running_up", "smollm2_tokenizer_dir", "sse_events", "tiny_llama_with_tokenizer",
    "tiny_llm_kwargs", "token_id_lists", "token_prompts",
]
