# SPDX-License-Identifier: Apache-2.0
"""An instance's measured prompt rate, so that the mixed pool can be keyed on seconds, not tokens.

A token threshold tuned on one machine fires all the time on a faster one (8192 pending prompt tokens are
16 s of a CPU core's work and well under a second of a GPU's). Seconds of the instance's own measured
work mean the same on both, and they are what a TTFT SLO speaks to. Pure logic: the caller passes the time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

NUM_SAMPLES = 8
"""Completions the rate is taken over: enough to smooth one odd prompt, few enough to follow a change."""


@dataclass
class PromptRate:
    """Prompt tokens per second of busy time, over an instance's last `NUM_SAMPLES` finished prefills.

    Busy time is time with at least one prompt booked and not finished. Each finished prefill is charged
    the busy time since the previous one finished (or since the instance got busy), so prompts that
    finish in one step together share that step's time. Time spent decoding whole requests in between
    slows the measured rate, as it slows the prompts queued behind it."""

    _samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=NUM_SAMPLES))
    _busy_since: float | None = None

    def on_busy(self, now: float) -> None:
        """The first prompt was booked on an idle instance."""
        self._busy_since = now

    def on_idle(self) -> None:
        """No prompt is booked any more: the time until the next one is not prefill time."""
        self._busy_since = None

    def on_prefill_done(self, num_tokens: int, now: float) -> None:
        if self._busy_since is None:
            return
        self._samples.append((num_tokens, max(0.0, now - self._busy_since)))
        self._busy_since = now

    @property
    def tokens_per_s(self) -> float | None:
        """None until some prefill has taken measurable time."""
        num_tokens = sum(n for n, _ in self._samples)
        busy_s = sum(s for _, s in self._samples)
        return num_tokens / busy_s if busy_s > 0 and num_tokens > 0 else None

    def seconds_for(self, num_tokens: int) -> float | None:
        """How long `num_tokens` prompt tokens take at the measured rate (None: not measured yet)."""
        rate = self.tokens_per_s
        return None if rate is None else num_tokens / rate
