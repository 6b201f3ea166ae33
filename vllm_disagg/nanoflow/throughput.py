# SPDX-License-Identifier: Apache-2.0
"""Achieved forward throughput as a fraction of NanoFlow's optimum (Eq. 9).

The analytic model is the planner's (`vllm_disagg.planner.nanoflow.optimal_throughput`), passed in
by `vllm_disagg.register()` (`set_optimum_model`); this module only supplies the device's measured peak dense FLOP/s (from the plan, or a short GEMM probe)
and aggregates per-step timings into a periodic log line.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0


def measure_peak_flops(dim: int = 1024, tokens: int = 512, reps: int = 5) -> float:
    """FLOP/s of a square-ish float32 GEMM on this thread's cores (the cost model's `Compute`)."""
    a = torch.randn(tokens, dim)
    w = torch.randn(dim, dim)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * tokens * dim * dim / best


OptimumModel = Callable[[Any, int, float, int], float]
"""(hf_config, dtype_bytes, peak_flops, tp) -> tokens/s at the compute bound (NanoFlow Eq. 9)."""

_optimum_model: OptimumModel | None = None


def set_optimum_model(model: OptimumModel | None) -> None:
    """The cost model the log compares against; `vllm_disagg.register()` passes the planner's, so
    nanoflow never imports the planner. Without one the log reports no fraction of optimal."""
    global _optimum_model
    _optimum_model = model


def optimal_tokens_per_s(hf_config: Any, dtype_bytes: int, peak_flops: float, tp: int = 1) -> float | None:
    """Eq. 9 via the cost model passed in; None when there is none."""
    if _optimum_model is None:
        logger.warning("nanoflow: no cost model passed in; not reporting %% of optimal")
        return None
    return _optimum_model(hf_config, dtype_bytes, peak_flops, tp)


class ThroughputLog:
    """Aggregates forward tokens/s and logs it against the optimum every LOG_EVERY_S."""

    def __init__(self, vllm_config: Any, plan: Any) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.last_log = time.monotonic()
        self.optimal: float | None = None
        try:
            model_config = vllm_config.model_config
            peak = plan.peak_flops or measure_peak_flops()
            dtype_bytes = torch.tensor([], dtype=model_config.dtype).element_size()
            tp = vllm_config.parallel_config.tensor_parallel_size
            self.optimal = optimal_tokens_per_s(model_config.hf_config, dtype_bytes, peak, tp)
        except (AttributeError, TypeError, ValueError) as err:
            logger.warning("nanoflow: cannot compute optimal throughput: %s", err)

    def record(self, num_tokens: int, seconds: float) -> None:
        self.tokens += num_tokens
        self.seconds += seconds
        now = time.monotonic()
        if now - self.last_log >= LOG_EVERY_S and self.seconds > 0:
            self.last_log = now
            logger.info("nanoflow: %s", self.summary())

    def summary(self) -> dict:
        achieved = self.tokens / self.seconds if self.seconds else 0.0
        frac = achieved / self.optimal if self.optimal else None
        return {
            "forward_tokens_per_s": round(achieved, 1),
            "optimal_tokens_per_s": None if self.optimal is None else round(self.optimal, 1),
            "fraction_of_optimal": None if frac is None else round(frac, 4),
        }


class PairedSteps:
    """A/B diagnostic (`VLLM_DISAGG_NANOFLOW_AB=1`): eligible steps of each token count alternate
    between the nano-batched and the plain forward; the summary compares them over the same step
    mix (only token counts seen both ways count), so load noise and batch composition cancel.

    Each step is timed twice: wall clock, and the CPU time of the forward's thread (only when the
    whole forward runs on that thread: inline executor, one OpenMP thread). On a shared box the CPU
    time leaves out the time other processes held the core, so it moves far less with load."""

    def __init__(self) -> None:
        self.plain_next = False
        self._flip: dict[int, bool] = {}
        self._buckets: dict[int, dict[str, list[float]]] = {}

    def choose_nano(self, num_tokens: int) -> bool:
        nano = not self._flip.get(num_tokens, False)
        self._flip[num_tokens] = nano
        self.plain_next = not nano
        return nano

    def record(self, which: str, num_tokens: int, seconds: float, cpu_seconds: float | None = None) -> None:
        self.plain_next = False
        bucket = self._buckets.setdefault(num_tokens, {"plain": [0.0, 0, 0.0], "nano": [0.0, 0, 0.0]})
        entry = bucket[which]
        entry[0] += seconds
        entry[1] += 1
        entry[2] = float("nan") if cpu_seconds is None else entry[2] + cpu_seconds

    def summary(self) -> dict | None:
        wall, cpu, steps = [0.0, 0.0], [0.0, 0.0], 0
        matched = []
        for tokens, bucket in self._buckets.items():
            plain_seconds, plain_steps, plain_cpu_seconds = bucket["plain"]
            nano_seconds, nano_steps, nano_cpu_seconds = bucket["nano"]
            if plain_steps and nano_steps:
                weight = plain_steps + nano_steps
                wall[0] += weight * plain_seconds / plain_steps
                wall[1] += weight * nano_seconds / nano_steps
                cpu[0] += weight * plain_cpu_seconds / plain_steps
                cpu[1] += weight * nano_cpu_seconds / nano_steps
                steps += weight
                matched.append((weight * tokens, tokens))
        if not steps:
            return None
        out = {
            "matched_steps": steps,
            "plain_s": wall[0],
            "nano_s": wall[1],
            "nano_over_plain": wall[0] / wall[1],
            "nano_over_plain_cpu_time": cpu[0] / cpu[1] if cpu[1] == cpu[1] and cpu[1] > 0 else None,
        }
        out["top_token_counts"] = self._top(sorted(matched, reverse=True)[:3])
        return out

    def _top(self, weighted: list[tuple[int, int]]) -> list[dict]:
        """The token counts carrying the most matched work, each with its own ratios."""
        rows = []
        for _, tokens in weighted:
            bucket = self._buckets[tokens]
            plain_seconds, plain_steps, plain_cpu_seconds = bucket["plain"]
            nano_seconds, nano_steps, nano_cpu_seconds = bucket["nano"]
            measured = not (math.isnan(plain_cpu_seconds) or math.isnan(nano_cpu_seconds))  # NaN: no CPU time
            cpu_ok = measured and nano_cpu_seconds > 0
            rows.append(
                {
                    "tokens": tokens,
                    "steps": plain_steps + nano_steps,
                    "nano_over_plain": round((plain_seconds / plain_steps) / (nano_seconds / nano_steps), 4),
                    "nano_over_plain_cpu_time": (
                        round((plain_cpu_seconds / plain_steps) / (nano_cpu_seconds / nano_steps), 4)
                        if cpu_ok else None
                    ),
                }
            )
        return rows
