# SPDX-License-Identifier: Apache-2.0
"""The chaos campaign's load: requests from a trace, and the greedy references they are checked against.

Each `ChaosRequest` is one prompt (seeded token ids scaled from a trace row's length) in one of four
forms: completions or chat, streamed or not. The references file holds plain vLLM's greedy float32
token ids for every form of every prompt, recorded once (`record_references`) so a run, CI's
included, needs no plain engine.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_disagg.planner.traces import load_azure_csv, rescale_rate

TRACE = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "azure_conv_2023_window_14340.csv"
REFERENCES = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "chaos_references.json"
FORMS = ("completions", "chat")
MODEL_LAYERS = 2


def chaos_model(workdir: Path) -> tuple[str, dict]:
    """The tiny seeded Llama (SmolLM2's tokenizer) every run uses, and its fingerprint (the references
    hold for this model only)."""
    from vllm_disagg.testing import tiny_llama_with_tokenizer

    path = tiny_llama_with_tokenizer(workdir / "model", num_hidden_layers=MODEL_LAYERS)
    digest = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix in (".json", ".safetensors"):
            digest.update(f.name.encode() + f.read_bytes())
    return str(path), {"kind": "tiny_llama_with_tokenizer", "num_hidden_layers": MODEL_LAYERS,
                       "sha256": digest.hexdigest()}


@dataclass(frozen=True)
class ChaosRequest:
    key: str
    """`<prompt index>/<form>`: what the references are keyed by."""
    arrival_s: float
    prompt_ids: tuple[int, ...]
    chat_text: str
    """The same ids decoded (chat has no token-id input)."""
    max_tokens: int
    form: str
    """completions | chat"""
    stream: bool
    disconnect_after: int | None = None
    """Close the stream after this many tokens (a client that leaves); None: read to the end."""


def prompts_from_trace(num: int, max_prompt_tokens: int, max_output_tokens: int, vocab: int,
                       seed: int = 0, trace: Path = TRACE) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per trace row: lengths scaled so the longest fits the caps."""
    rows = load_azure_csv(trace, limit=num)
    top_p = max(r.num_prompt_tokens for r in rows)
    top_o = max(r.num_output_tokens for r in rows)
    rng = random.Random(seed)
    out = []
    for r in rows:
        n = max(4, round(r.num_prompt_tokens * max_prompt_tokens / top_p))
        m = max(8, round(r.num_output_tokens * max_output_tokens / top_o))
        out.append(([rng.randrange(100, vocab - 100) for _ in range(n)], m))
    return out


def schedule(num: int, rps: float, seed: int = 0, disconnect_share: float = 0.1,
             trace: Path = TRACE) -> list[tuple[float, int, str, bool, bool]]:
    """(arrival s, prompt index, form, stream, disconnects) per request: the trace's arrival shape
    rescaled to `rps`, forms and modes drawn from a seeded RNG."""
    rows = rescale_rate(load_azure_csv(trace, limit=num), rps)
    rng = random.Random(seed + 1)
    out = []
    for i, r in enumerate(rows):
        stream = rng.random() < 0.5
        out.append((r.arrival_s, i, rng.choice(FORMS), stream, stream and rng.random() < disconnect_share))
    return out


@dataclass
class References:
    """Greedy token ids of plain vLLM per `<prompt>/<form>`, with what they were recorded from."""

    model: dict
    prompts: list[dict]
    """{"prompt_ids": [...], "chat_text": str, "max_tokens": int}"""
    outputs: dict[str, list[int]]

    def save(self, path: Path = REFERENCES) -> None:
        path.write_text(json.dumps(asdict(self), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path = REFERENCES) -> References:
        return cls(**json.loads(path.read_text()))

    def requests(self, plan: list[tuple[float, int, str, bool, bool]], seed: int = 0) -> list[ChaosRequest]:
        rng = random.Random(seed + 2)
        out = []
        for arrival, i, form, stream, leaves in plan:
            p = self.prompts[i % len(self.prompts)]
            cut = rng.randint(1, max(1, p["max_tokens"] - 1)) if leaves else None
            out.append(ChaosRequest(f"{i % len(self.prompts)}/{form}", arrival, tuple(p["prompt_ids"]),
                                    p["chat_text"], p["max_tokens"], form, stream, cut))
        return out
