# SPDX-License-Identifier: Apache-2.0
"""Measured profiles (`--profile measured.json`): calibration for every model.

Schema `vllm-disagg-profile/1` (documented in README.md). Every section is
optional; a model uses the measured curve when present and its roofline
default otherwise. Curves are piece-wise linear in their first key, as
Splitwise's performance model (§V-B), and extrapolate linearly.

    {"schema": "vllm-disagg-profile/1", "device": "...", "model": "...",
     "prefill":     [{"num_tokens": 128, "ms": 9.1}, ...],
     "decode":      [{"batch_size": 1, "ms": 4.2, "context_tokens": 512}, ...],
     "kv_transfer": [{"num_tokens": 128, "ms": 0.8}, ...],
     "mtime":       [{"batch_size": 1, "ms": 3.0}, ...],
     "atime":       [{"batch_size": 1, "context_tokens": 4096, "ms": 0.5}, ...],
     "ops":         {"GEMM-KQV": [{"num_tokens": 2048, "ms": 16.08}], ...},
     "measured":    {"ttft_ms_p50": .., "tbt_ms_p50": .., "rps": ..,
                     "prompt_tokens": .., "output_tokens": .., "num_requests": ..}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = "vllm-disagg-profile/1"
_CURVES = {"prefill": "num_tokens", "decode": "batch_size", "kv_transfer": "num_tokens",
           "mtime": "batch_size", "atime": "batch_size"}


@dataclass(frozen=True)
class Curve:
    """Piece-wise linear y(x) through measured points, linear beyond them."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def from_points(cls, points: list[dict], x_key: str, y_key: str = "ms") -> Curve:
        if not points:
            raise ValueError(f"empty curve for {x_key}")
        pairs = sorted((float(p[x_key]), float(p[y_key])) for p in points)
        merged: dict[float, list[float]] = {}
        for x, y in pairs:
            merged.setdefault(x, []).append(y)
        xs = tuple(merged)
        return cls(xs, tuple(float(np.mean(merged[x])) for x in xs))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * (x / xs[0] if xs[0] else 1.0)  # one point: proportional
        if x <= xs[0]:
            i = 0
        elif x >= xs[-1]:
            i = len(xs) - 2
        else:
            return float(np.interp(x, xs, ys))
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, ys[i] + slope * (x - xs[i]))


@dataclass
class Profile:
    """A parsed measured profile; absent sections are None."""

    device: str = ""
    model: str = ""
    curves: dict[str, Curve] = field(default_factory=dict)
    decode_context_ms_per_token: float = 0.0
    """Extra decode ms per batched context token, fitted when points vary it."""
    decode_context_ref: float | None = None
    """Mean per-request context of the decode points (tokens)."""
    atime_context_ref: float | None = None
    ops: dict[str, Curve] = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    prefill_quadratic: tuple[float, float, float] | None = None
    """(a, b, c) of a + b*n + c*n^2 ms, fitted to `prefill` when the profile asks for it
    (`"prefill_fit": "quadratic"`): a batch of prompts then costs a + b*sum(n) + c*sum(n^2),
    attention being quadratic per prompt, not in the batch's total tokens."""

    def curve(self, name: str) -> Curve | None:
        return self.curves.get(name)


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file; errors name the bad section."""
    data = json.loads(Path(path).read_text())
    return parse_profile(data)


def parse_profile(data: dict) -> Profile:
    schema = data.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ValueError(f"profile schema {schema!r} not supported (want {SCHEMA!r})")
    prof = Profile(device=data.get("device", ""), model=data.get("model", ""),
                   measured=dict(data.get("measured", {})))
    for name, x_key in _CURVES.items():
        if data.get(name):
            try:
                prof.curves[name] = Curve.from_points(data[name], x_key)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"profile section {name!r}: {exc}") from exc
    prof.decode_context_ms_per_token = _context_slope(data.get("decode") or [])
    prof.decode_context_ref = _mean_context(data.get("decode"))
    prof.atime_context_ref = _mean_context(data.get("atime"))
    for op, points in (data.get("ops") or {}).items():
        prof.ops[op] = Curve.from_points(points, "num_tokens")
    fit = data.get("prefill_fit", "piecewise")
    if fit not in ("piecewise", "quadratic"):
        raise ValueError(f"profile prefill_fit {fit!r}: want 'piecewise' or 'quadratic'")
    if fit == "quadratic" and data.get("prefill"):
        prof.prefill_quadratic = _quadratic_fit(data["prefill"])
    return prof


def _quadratic_fit(points: list[dict]) -> tuple[float, float, float]:
    """Least squares a + b*n + c*n^2 with a, b, c >= 0 (linear, then constant, if a term goes negative)."""
    n = np.array([p["num_tokens"] for p in points], float)
    ms = np.array([p["ms"] for p in points], float)
    for cols in ((0, 1, 2), (1, 2), (0, 1), (1,), (0,)):
        basis = np.column_stack([n ** k for k in cols])
        coef, *_ = np.linalg.lstsq(basis, ms, rcond=None)
        if (coef >= 0).all():
            out = [0.0, 0.0, 0.0]
            for k, v in zip(cols, coef):
                out[k] = float(v)
            return out[0], out[1], out[2]
    return float(ms.mean()), 0.0, 0.0


def _mean_context(points: list[dict] | None) -> float | None:
    ctx = [p["context_tokens"] for p in points or [] if p.get("context_tokens")]
    return float(np.mean(ctx)) if ctx else None


def _context_slope(points: list[dict]) -> float:
    """Least-squares ms per context token at fixed batch size (0 if unknown)."""
    pts = [p for p in points if "context_tokens" in p]
    if len({p["context_tokens"] for p in pts}) < 2:
        return 0.0
    ctx = np.array([p["context_tokens"] * p["batch_size"] for p in pts], float)
    ms = np.array([p["ms"] for p in pts], float)
    bs = np.array([p["batch_size"] for p in pts], float)
    a = np.column_stack([np.ones_like(ctx), bs, ctx])
    coef, *_ = np.linalg.lstsq(a, ms, rcond=None)
    return max(0.0, float(coef[2]))
