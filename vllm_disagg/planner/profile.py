# SPDX-License-Identifier: Apache-2.0
"""Measured profiles (`--profile measured.json`): calibration for every model.

Schema `vllm-disagg-profile/1` (documented in README.md). Every section is
optional; a model uses the measured curve when present and its roofline
default otherwise. Curves are piece-wise linear in their first key, as
Splitwise's performance model (§V-B), and extrapolate linearly.

More: README.md, "profile.py".
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
    prefill_quadratic: tuple[float, float, float, float] | None = None
    """(a, b, c, d) of one prompt iteration's ms = a + b*T + c*sum(n^2) + d*T^2 (T = the batch's
    tokens, n = each prompt's), fitted when the profile asks for it (`"prefill_fit": "quadratic"`).
    c is what grows per prompt (attention), d what grows with the whole batch (e.g. dense layers
    slowing down once activations leave the cache). Single prompts (T = n) cannot tell c from d:
    only `prefill_batched` points (k prompts queued into one step) can. Without them d = 0, i.e.
    the unmeasured assumption that a batch pays attention per prompt and nothing more."""
    step_jitter: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(quantiles, ratios): how one engine step's time spreads around its curve's value, as measured
    (token gaps over their point's median, pooled over the decode points). The curves are medians;
    a served trace's tail gaps are not, so the simulator draws each decode step's factor from this."""

    decode_join_ms: float = 0.0
    """Extra ms of a decode step for each pushed request that joins the batch in it (vLLM computes its
    prompt's last token there, over the whole context); measured as `decode_join`, 0 when absent."""
    decode_prefill_ratio: float = 1.0
    """A decode step's time over its curve's while another instance on the same host computes a prompt
    step (they share caches and memory bandwidth); measured as `decode_while_prefilling`, 1 when absent.
    Applied only where the simulated machines share a host (`SimOptions.shared_host`)."""
    prefill_step_jitter: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(quantiles, ratios) of those steps, over the idle curve's time (`decode_while_prefilling`'s
    `step_jitter`): where measured, a step beside a prompt step draws its factor from this instead of
    `step_jitter` times `decode_prefill_ratio` (the tail beside a prefill is heavier than a shift)."""

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
            points = data[name] + (_batched_as_total(data) if name == "prefill" else [])
            try:
                prof.curves[name] = Curve.from_points(points, x_key)
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
        prof.prefill_quadratic = _quadratic_fit(data["prefill"], data.get("prefill_batched") or [])
    if data.get("step_jitter"):
        prof.step_jitter = _jitter(data["step_jitter"])
    if data.get("decode_join"):
        prof.decode_join_ms = _join_ms(data["decode_join"])
    if data.get("decode_while_prefilling"):
        prof.decode_prefill_ratio = _prefill_ratio(data["decode_while_prefilling"])
        if data["decode_while_prefilling"].get("step_jitter"):
            prof.prefill_step_jitter = _jitter(data["decode_while_prefilling"]["step_jitter"],
                                               "decode_while_prefilling.step_jitter")
    return prof


def _prefill_ratio(section: dict) -> float:
    try:
        ratio = float(section["ratio"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile section 'decode_while_prefilling': {exc!r}") from exc
    if not 0.5 <= ratio <= 4.0:
        raise ValueError(f"profile section 'decode_while_prefilling': ratio {ratio} is not a step-time ratio "
                         "(0.5 to 4)")
    return ratio


def _join_ms(section: dict) -> float:
    try:
        ms = float(section["ms"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile section 'decode_join': {exc!r}") from exc
    if not 0.0 <= ms < 1e6:
        raise ValueError(f"profile section 'decode_join': ms {ms} is not a step's extra time (>= 0)")
    return ms


def _jitter(section: dict, name: str = "step_jitter") -> tuple[tuple[float, ...], tuple[float, ...]]:
    try:
        qs, ratios = tuple(float(q) for q in section["quantiles"]), tuple(float(r) for r in section["ratios"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"profile section {name!r}: {exc!r}") from exc
    if (len(qs) != len(ratios) or len(qs) < 2 or not all(0.0 <= q <= 1.0 for q in qs)
            or list(qs) != sorted(qs) or list(ratios) != sorted(ratios) or ratios[0] <= 0):
        raise ValueError(f"profile section {name!r}: quantiles in [0, 1] and positive ratios, both "
                         "ascending and of one length >= 2")
    return qs, ratios


def _batched_as_total(data: dict) -> list[dict]:
    """Piece-wise fit (Splitwise's form: an iteration costs the curve at its batch tokens): a batch of
    k prompts of n tokens is one more point at k*n tokens. Quadratic fits use them separately."""
    if data.get("prefill_fit", "piecewise") != "piecewise":
        return []
    try:
        return [{"num_tokens": int(p["num_prompts"]) * p["num_tokens"], "ms": p["ms"]}
                for p in data.get("prefill_batched") or []]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"profile section 'prefill_batched': {exc}") from exc


def _quadratic_fit(points: list[dict], batched: list[dict] = ()) -> tuple[float, float, float, float]:
    """Non-negative least squares of ms = a + b*T + c*sum(n^2) + d*T^2 over single prompts
    (`points`) and batches of `num_prompts` equal prompts (`batched`); see Profile.prefill_quadratic.

    Exact NNLS by enumeration: the best of the unconstrained fits on every subset of the four
    terms whose coefficients are all >= 0. d only enters when batched points separate it from c."""
    rows = [(1, p["num_tokens"], p["ms"]) for p in points]
    try:
        rows += [(int(p["num_prompts"]), p["num_tokens"], p["ms"]) for p in batched]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"profile section 'prefill_batched': {exc}") from exc
    k, n, ms = (np.array(col, float) for col in zip(*rows))
    total = k * n
    terms = np.column_stack([np.ones_like(n), total, k * n * n, total * total])
    usable = (0, 1, 2, 3) if (k > 1).any() else (0, 1, 2)
    best, best_err = (float(ms.mean()), 0.0, 0.0, 0.0), np.inf
    for mask in range(1, 1 << len(usable)):
        cols = [c for i, c in enumerate(usable) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(terms[:, cols], ms, rcond=None)
        if (coef < 0).any():
            continue
        err = float(np.sum((terms[:, cols] @ coef - ms) ** 2))
        if err < best_err * (1 - 1e-9):  # ties: the first (simplest) subset wins
            out = [0.0] * 4
            for c, v in zip(cols, coef):
                out[c] = float(v)
            best, best_err = (out[0], out[1], out[2], out[3]), err
    return best


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
