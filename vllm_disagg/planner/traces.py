# SPDX-License-Identifier: Apache-2.0
"""Request traces: Azure LLM inference CSVs, or synthetic coding/conversation traces.

Azure format (AzurePublicDataset, AzureLLMInferenceDataset2023):
`TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps as
`2023-11-16 18:15:46.6805900` or plain seconds.

`trace_window`, `cap_lengths`, `timed_trace_lines`: a trace slice as the JSONL `vllm bench serve
--dataset-name timed_trace` replays (benchmarks/serve_bench.py). More: README.md, "traces.py".
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    req_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class LengthStats:
    """Median and mean of a length distribution (tokens)."""

    median: float
    mean: float

    @classmethod
    def from_mean_std(cls, mean: float, std: float) -> LengthStats:
        """Log-normal with this mean and std: median = mean/sqrt(1 + cv^2)."""
        return cls(mean / math.sqrt(1 + (std / mean) ** 2), mean)

    @property
    def sigma(self) -> float:
        """Log-normal sigma with mean/median = exp(sigma^2/2)."""
        return math.sqrt(2 * math.log(self.mean / self.median))


# Splitwise §III medians; Lamina Table 4 means (Azure-Code / Azure-Conv).
_CODING = (LengthStats(1500, 2047.8), LengthStats(13, 27.9))
_CONVERSATION = (LengthStats(1020, 1154.7), LengthStats(129, 211.1))
TRACE_STATS = {
    "coding": _CODING,
    "conversation": _CONVERSATION,
    "coding-lognormal": _CODING,
    "conversation-lognormal": _CONVERSATION,
    # NanoFlow Table 3: mean (std) of input and output tokens.
    "splitwise": (LengthStats.from_mean_std(1155, 1109), LengthStats.from_mean_std(211, 163)),
    "lmsys": (LengthStats.from_mean_std(102, 169), LengthStats.from_mean_std(222, 210)),
    "sharegpt": (LengthStats.from_mean_std(246, 547), LengthStats.from_mean_std(322, 244)),
}
MAX_PROMPT_TOKENS = 32768


def synthetic_trace(kind: str, rps: float, duration_s: float | None = None,
                    num_requests: int | None = None, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals at `rps` with the named trace's length statistics."""
    if kind not in TRACE_STATS:
        raise ValueError(f"unknown trace {kind!r}; choose from {sorted(TRACE_STATS)}")
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    rng = np.random.default_rng(seed)
    n = num_requests if num_requests is not None else max(1, int(round(rps * duration_s)))
    arrivals = np.cumsum(rng.exponential(1.0 / rps, size=n))
    if kind in _empirical():
        prompts, outputs = _empirical_lengths(rng, kind, n)
    else:
        prompt_s, output_s = TRACE_STATS[kind]
        prompts = _lognormal(rng, prompt_s, n, MAX_PROMPT_TOKENS)
        outputs = _lognormal(rng, output_s, n, 8192)
    return [TraceRequest(f"{kind}-{i}", float(t), int(p), int(o))
            for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def _lognormal(rng: np.random.Generator, stats: LengthStats, n: int, cap: int) -> np.ndarray:
    x = rng.lognormal(math.log(stats.median), stats.sigma, size=n)
    return np.clip(np.rint(x), 1, cap).astype(int)


@lru_cache(maxsize=1)
def _empirical() -> dict:
    data = json.loads((Path(__file__).parent / "data" / "trace_lengths.json").read_text())
    return {k: v for k, v in data.items() if isinstance(v, dict)} | {"_q": data["quantiles"]}


def _empirical_lengths(rng: np.random.Generator, kind: str, n: int) -> tuple[np.ndarray, ...]:
    """Inverse-CDF draws through the stored quantiles (prompt and output independent,
    as SplitwiseSim samples them)."""
    table, qs = _empirical()[kind], _empirical()["_q"]
    out = []
    for key in ("prompt_tokens", "output_tokens"):
        x = np.interp(rng.uniform(0.0, 100.0, size=n), qs, table[key])
        out.append(np.maximum(1, np.rint(x)).astype(int))
    return tuple(out)


def resample_poisson(base: list[TraceRequest], rps: float, duration_s: float,
                     seed: int = 0) -> list[TraceRequest]:
    """SplitwiseSim's trace generation: Poisson arrivals at `rps`, each request's
    (prompt, output) sizes drawn with replacement from `base` (e.g. an Azure CSV)."""
    if not base:
        return []
    rng = np.random.default_rng(seed)
    n = max(1, int(round(rps * duration_s)))
    arrivals = np.cumsum(rng.exponential(1.0 / rps, size=n))
    picks = rng.integers(0, len(base), size=n)
    return [TraceRequest(f"poisson-{i}", float(t), base[j].num_prompt_tokens,
                         base[j].num_output_tokens)
            for i, (t, j) in enumerate(zip(arrivals, picks))]


def load_azure_csv(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read an Azure LLM trace CSV; arrivals are made relative to the first row."""
    rows: list[tuple[float, int, int]] = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            keys = {k.strip().lower(): v for k, v in row.items() if k}
            try:
                rows.append((_timestamp(keys["timestamp"]), int(keys["contexttokens"]),
                             int(keys["generatedtokens"])))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}: bad row {row}: {exc}") from exc
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        return []
    rows.sort()
    t0 = rows[0][0]
    stem = Path(path).stem
    return [TraceRequest(f"{stem}-{i}", t - t0, max(1, p), max(1, o))
            for i, (t, p, o) in enumerate(rows)]


def _timestamp(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    head, _, frac = text.partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def rescale_rate(trace: list[TraceRequest], rps: float) -> list[TraceRequest]:
    """Stretch arrival times so the trace runs at `rps` on average."""
    if len(trace) < 2 or trace[-1].arrival_s <= 0:
        return list(trace)
    factor = (len(trace) / rps) / trace[-1].arrival_s
    return [TraceRequest(r.req_id, r.arrival_s * factor, r.num_prompt_tokens,
                         r.num_output_tokens) for r in trace]


def describe(trace: list[TraceRequest]) -> dict:
    """Summary statistics, for reports and tests."""
    p = np.array([r.num_prompt_tokens for r in trace])
    o = np.array([r.num_output_tokens for r in trace])
    span = trace[-1].arrival_s if trace else 0.0
    return {"num_requests": len(trace), "rps": len(trace) / span if span else 0.0,
            "prompt_median": float(np.median(p)), "prompt_mean": float(p.mean()),
            "output_median": float(np.median(o)), "output_mean": float(o.mean())}


def trace_window(trace: list[TraceRequest], start: int, num: int) -> list[TraceRequest]:
    """`num` consecutive requests from index `start`, arrivals re-based so the first is at 0."""
    if start < 0 or num < 1 or start + num > len(trace):
        raise ValueError(f"window [{start}, {start + num}) is outside the trace's {len(trace)} requests")
    rows = trace[start:start + num]
    t0 = rows[0].arrival_s
    return [TraceRequest(r.req_id, r.arrival_s - t0, r.num_prompt_tokens, r.num_output_tokens) for r in rows]


def cap_lengths(trace: list[TraceRequest], max_model_len: int,
                max_output_tokens: int | None = None) -> list[TraceRequest]:
    """Fit every request into the model: output first capped to `max_output_tokens` (default a quarter
    of the context), then the prompt to what is left, so prompt + output <= max_model_len."""
    max_out = max_output_tokens or max_model_len // 4
    if not 1 <= max_out < max_model_len:
        raise ValueError(f"max_output_tokens {max_out} must be in [1, {max_model_len})")
    out = []
    for r in trace:
        o = min(r.num_output_tokens, max_out)
        out.append(TraceRequest(r.req_id, r.arrival_s, max(1, min(r.num_prompt_tokens, max_model_len - o)), o))
    return out


def timed_trace_lines(trace: list[TraceRequest], chunk_tokens: int = 16, first_id: int = 0) -> list[str]:
    """One JSON line per request for `vllm bench serve --dataset-name timed_trace`.

    The client builds each prompt from `hash_ids`, one chunk of `chunk_tokens` tokens per id
    (`--timed-trace-chunk-hash-size`); an entry without ids gets an empty prompt, and ids shared
    between requests become a shared prefix. Every request gets ids of its own: no prefix is shared.
    The client seeds a chunk's tokens with Python's string hash: run it with PYTHONHASHSEED fixed, or
    every run replays different prompts. Replaying the same ids twice on one server measures its
    prefix cache, not prefill: give each replay its own `first_id` range."""
    lines, next_id = [], first_id
    for r in trace:
        num_ids = -(-r.num_prompt_tokens // chunk_tokens)
        lines.append(json.dumps({"timestamp": round(r.arrival_s, 6), "input_length": r.num_prompt_tokens,
                                 "output_length": r.num_output_tokens,
                                 "hash_ids": list(range(next_id, next_id + num_ids))}))
        next_id += num_ids
    return lines


def representative_window(trace: list[TraceRequest], num: int, step: int | None = None) -> int:
    """Start index of the `num`-request window whose median prompt and output lengths are closest (in
    log ratio) to the whole trace's: a short window of a real trace can be far from it (the first 60
    requests of the Azure conversation trace have a median prompt of 376 tokens; the trace's is 1020)."""
    if num > len(trace):
        raise ValueError(f"window of {num} requests > the trace's {len(trace)}")
    p = np.array([r.num_prompt_tokens for r in trace], float)
    o = np.array([r.num_output_tokens for r in trace], float)
    med_p, med_o = np.median(p), np.median(o)
    best, best_err = 0, np.inf
    for start in range(0, len(trace) - num + 1, step or max(1, num // 2)):
        err = abs(np.log(np.median(p[start:start + num]) / med_p)) + abs(np.log(np.median(o[start:start + num]) / med_o))
        if err < best_err:
            best, best_err = start, err
    return best
