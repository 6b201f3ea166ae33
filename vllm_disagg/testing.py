# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests and benchmarks: a tiny random-weight Llama and the environment vLLM needs here.

The tiny model is a `config.json` only; load it with `load_format="dummy"` and
`skip_tokenizer_init=True`, and pass prompts as token ids. Its output is gibberish but deterministic,
which is what equivalence tests need.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

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


def make_tiny_llama(path: str | os.PathLike, **overrides) -> Path:
    """Write a tiny Llama `config.json` into `path` and return the directory."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**TINY_LLAMA_CONFIG, **overrides}, indent=1))
    return out


def tiny_llm_kwargs(model_dir: str | os.PathLike, **overrides) -> dict:
    """Keyword arguments for `vllm.LLM` that load the tiny model fast and comparably (float32)."""
    kwargs = dict(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=2048,
        enable_prefix_caching=False,
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def token_prompts(num: int, length: int, vocab: int = 512, seed: int = 0) -> list[dict]:
    """Deterministic token-id prompts of `length` tokens each, as `{"prompt_token_ids": [...]}`."""
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(num)]
