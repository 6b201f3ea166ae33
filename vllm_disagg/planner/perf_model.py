# SPDX-License-Identifier: Apache-2.0
"""Splitwise's LLM performance model (§V-B): iteration time vs tokens and batch.

Piece-wise linear curves (the paper's form) from, in order of preference:
a measured profile (`--profile`), the built-in curves in
`data/perf_models.json` (Llama2-70B on DGX-A100/H100, anchored on Splitwise
Table IV), or a roofline of the model on the machine with fixed overheads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec
from vllm_disagg.planner.profile import Curve, Profile, parse_profile

PROMPT_TOKEN_CAP = 2048
"""Splitwise §IV-B: batched prompts are capped at 2048 tokens."""
ROOFLINE_COMPUTE_EFF = 0.5
ROOFLINE_MEMORY_EFF = 0.6
ROOFLINE_OVERHEAD_MS = 5.0
KV_LINK_EFF = 0.9


@lru_cache(maxsize=1)
def _builtin() -> dict:
    return json.loads((Path(__file__).parent / "data" / "perf_models.json").read_text())


@dataclass
class PerfModel:
    """Times (ms) of prompt, token and mixed iterations on one machine."""

    machine: HardwareSpec
    model: ModelSpec
    prefill_curve: Curve
    decode_curve: Curve
    decode_ref_context: float
    kv_ms_per_context_token: float
    kv_transfer_curve: Curve | None = None
    source: str = "roofline"
    prefill_quadratic: tuple[float, float, float, float] | None = None
    """Measured a + b*T + c*sum(n^2) + d*T^2 (see Profile.prefill_quadratic); None = the curve of
    batch tokens."""
    decode_join_ms: float = 0.0
    """Extra ms per pushed request joining a decode batch (Profile.decode_join_ms)."""
    decode_prefill_ratio: float = 1.0
    """Decode step time factor while another machine of the host prefills (Profile.decode_prefill_ratio)."""

    def prefill_ms(self, num_tokens: int) -> float:
        return self.prefill_curve(max(1, num_tokens))

    def prefill_batch_ms(self, prompt_lengths: list[int], prior_tokens: list[int] | None = None) -> float:
        """One prompt iteration over these prompts (or chunks, after `prior_tokens` computed ones).
        Splitwise's form (and SplitwiseSim's) is the curve at the batch's total tokens; a quadratic
        profile splits per-prompt growth (a chunk of m after p pays (p+m)^2 - p^2) from per-batch growth."""
        if self.prefill_quadratic is None:
            return self.prefill_ms(sum(prompt_lengths))
        a, b, c, d = self.prefill_quadratic
        prior = prior_tokens or [0] * len(prompt_lengths)
        total = sum(prompt_lengths)
        per_prompt = sum((p + m) ** 2 - p * p for m, p in zip(prompt_lengths, prior))
        return a + b * total + c * per_prompt + d * total * total

    def decode_ms(self, batch_size: int, num_context_tokens: int) -> float:
        """One token for each of `batch_size` requests holding the given KV."""
        extra = num_context_tokens - batch_size * self.decode_ref_context
        return max(0.1, self.decode_curve(batch_size) + self.kv_ms_per_context_token * extra)

    def mixed_ms(self, num_prompt_tokens: int, batch_size: int, num_context_tokens: int,
                 prompt_lengths: list[int] | None = None, prior_tokens: list[int] | None = None) -> float:
        """Mixed batching (Sarathi-style): decode tokens ride in the dense batch."""
        if num_prompt_tokens == 0:
            return self.decode_ms(batch_size, num_context_tokens)
        lengths = list(prompt_lengths) if prompt_lengths else [num_prompt_tokens]
        prior = list(prior_tokens) if prior_tokens else [0] * len(lengths)
        return self.prefill_batch_ms(lengths + [1] * batch_size, prior + [0] * batch_size) + (
            self.kv_ms_per_context_token * num_context_tokens)

    def kv_serialized_ms(self, num_tokens: int) -> float:
        """Whole-prompt KV transfer after the prompt phase (§IV-C, Fig. 11a)."""
        if self.kv_transfer_curve is not None:
            return self.kv_transfer_curve(num_tokens)
        link = self.machine.nic_gbs * 1e9 * KV_LINK_EFF
        return 1e3 * num_tokens * self.model.kv_bytes_per_token / link if link else 0.0

    def kv_visible_ms(self, num_tokens: int, layerwise: bool) -> float:
        """Transfer time the request sees after its prompt phase ends.

        Layer-wise: all but the last layer overlap the prompt computation,
        leaving a small constant (§VI-A: ~8 ms A100, ~5 ms H100)."""
        ser = self.kv_serialized_ms(num_tokens)
        if not layerwise:
            return ser
        hidden = max(0.0, ser - self.prefill_ms(num_tokens))
        return max(self.machine.kv_layerwise_overhead_ms, ser / self.model.num_layers) + hidden


def build_perf_model(model: ModelSpec, machine: HardwareSpec,
                     profile: Profile | None = None) -> PerfModel:
    """Pick profile > built-in curves > roofline, per curve."""
    key = f"{model.name}@{machine.extra.get('perf_as', machine.name)}"
    source, data = "roofline", None
    if profile is not None and profile.curve("prefill") and profile.curve("decode"):
        source = "profile"
    elif key in _builtin():
        source, data = "builtin", parse_profile(_builtin()[key])
    prof = profile if source == "profile" else data
    kv_slope = _roofline_kv_ms(model, machine)
    if prof is None:
        pre, dec, ref = _roofline_curves(model, machine)
        return PerfModel(machine, model, pre, dec, ref, kv_slope, None, source)
    ref = prof.decode_context_ref if prof.decode_context_ref else 0.0
    # A measured profile is trusted as is (its fitted slope, 0 if it has no
    # context variation); the built-in curves add the roofline KV-read cost.
    slope = prof.decode_context_ms_per_token if source == "profile" else kv_slope
    return PerfModel(machine, model, prof.curve("prefill"), prof.curve("decode"), ref, slope,
                     prof.curve("kv_transfer"), source, prof.prefill_quadratic,
                     prof.decode_join_ms if source == "profile" else 0.0,
                     prof.decode_prefill_ratio if source == "profile" else 1.0)


def _roofline_kv_ms(model: ModelSpec, machine: HardwareSpec) -> float:
    return 1e3 * model.kv_bytes_per_token / (machine.mem_bw_gbs * 1e9 * ROOFLINE_MEMORY_EFF)


def _roofline_curves(model: ModelSpec, machine: HardwareSpec) -> tuple[Curve, Curve, float]:
    """Compute- or weight-bound iteration times with a fixed overhead."""
    flops = machine.fp16_tflops * 1e12 * ROOFLINE_COMPUTE_EFF
    bw = machine.mem_bw_gbs * 1e9 * ROOFLINE_MEMORY_EFF

    def t(tokens: int) -> float:
        return ROOFLINE_OVERHEAD_MS + 1e3 * max(2 * model.compute_params * tokens / flops,
                                                model.weight_bytes / bw)
    xs = (1, 64, 256, 1024, 2048, 4096, 8192)
    curve = Curve(xs, tuple(t(x) for x in xs))
    return curve, curve, 0.0
