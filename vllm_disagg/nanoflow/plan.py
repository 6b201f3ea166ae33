# SPDX-License-Identifier: Apache-2.0
"""The nano-batch plan: what `vllm-disagg tune` writes and the executor loads.

A plan fixes the nano-batch count per op group, the share of execution units per unit class, the
dense batch size (discrete batching) and, when profiled, per-op costs that order the ops. A plan
written for another model or device still loads; the worker logs the mismatch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_disagg.envs import cache_dir

logger = logging.getLogger(__name__)

PLAN_VERSION = 1
# Version history: 1 = first format (nano_batches per op group, unit shares, dense batch, costs).


class NanoBatchCounts(BaseModel):
    """Nano-batches per op group; attention/KQV use the finer split (paper: 4 vs 2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attn: int = Field(2, ge=1, le=64)
    """KQV generation and attention (fine nano-batches)."""
    dense: int = Field(2, ge=1, le=64)
    """O projection, all-reduce and Up/Gate/Down (coarse nano-batches)."""

    @model_validator(mode="after")
    def _fine_refines_coarse(self) -> NanoBatchCounts:
        if self.attn % self.dense:
            raise ValueError(f"attn ({self.attn}) must be a multiple of dense ({self.dense})")
        return self


class NanoFlowPlan(BaseModel):
    """One tuned configuration of the nano-batch executor."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = PLAN_VERSION
    nano_batches: NanoBatchCounts = NanoBatchCounts()
    units: dict[str, int] = Field(default_factory=dict)
    """Execution-unit share per unit class ("dense", "attn", "net"): cores on CPU, SMs on GPU.
    Empty = one unit with the whole device (inline: nano-batches run sequentially)."""
    threaded: bool = True
    """Run unit classes on their own threads/streams; False = inline (nothing overlaps)."""
    dense_batch_size: int | None = None
    """Discrete batching: the profiled fast size to use as max_num_batched_tokens."""
    break_even_tokens: int | None = None
    """Steps with fewer tokens run un-split (vLLM's plain forward): below it the split is not
    predicted to pay (`nanoflow/auto.py`). None: every step with enough tokens is split."""
    fast_sizes: list[int] = Field(default_factory=list)
    """Token counts whose dense throughput beats every smaller size (profiled)."""
    op_cost_s: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Profiled seconds per op name per token count, at the planned unit share."""
    predicted_step_s: float | None = None
    predicted_tokens_per_s: float | None = None
    peak_flops: float | None = None
    """Measured dense GEMM FLOP/s of the whole device (the cost model's `Compute`)."""
    model: str | None = None
    device: str | None = None
    search: dict[str, Any] = Field(default_factory=dict)
    """Provenance: candidates tried, seconds spent, profile grid."""

    def min_tokens(self) -> int:
        return self.nano_batches.attn

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> NanoFlowPlan:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"nanoflow plan {path}: cannot read ({err}); run `vllm-disagg tune`") from None
        if raw.get("version") != PLAN_VERSION:
            raise ValueError(
                f"nanoflow plan {path}: version {raw.get('version')!r}, expected {PLAN_VERSION}; "
                "re-run `vllm-disagg tune`"
            )
        return cls.model_validate(raw)


def default_plan_path(model: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(model).strip("/"))
    return cache_dir() / "nanoflow" / f"{safe[-120:]}.json"


def resolve_plan(
    nano_batches: int | str, plan_path: str | None, model: str, network_op: bool = False
) -> NanoFlowPlan:
    """The plan for a NanoFlowSection: an explicit count, or "auto" (the tuned plan; without one,
    n=1 unless a network-bound op exists, `network_op`, see nanoflow/auto.py)."""
    if plan_path:
        plan = NanoFlowPlan.load(plan_path)
        if nano_batches != "auto":
            plan = plan.model_copy(update={"nano_batches": _counts(int(nano_batches)), "break_even_tokens": None})
        return plan
    if nano_batches == "auto":
        path = default_plan_path(model)
        if path.exists():
            return NanoFlowPlan.load(path)
        from vllm_disagg.nanoflow.auto import DEFAULT_NETWORK_BREAK_EVEN

        if not network_op:
            logger.info("nanoflow: nano_batches=auto, no plan at %s and no network-bound op to overlap: "
                        "n=1, vLLM's plain forward (`vllm-disagg tune` profiles this device)", path)
            return NanoFlowPlan(nano_batches=_counts(1), break_even_tokens=None)
        logger.info("nanoflow: nano_batches=auto, no plan at %s: 2 nano-batches on steps of >= %d tokens "
                    "(a network-bound op overlaps)", path, DEFAULT_NETWORK_BREAK_EVEN)
        return NanoFlowPlan(break_even_tokens=DEFAULT_NETWORK_BREAK_EVEN)
    return NanoFlowPlan(nano_batches=_counts(int(nano_batches)))


def _counts(n: int) -> NanoBatchCounts:
    """N nano-batches: attention/KQV use N, dense ops N/2 when N >= 4 (the paper's 4/2 split)."""
    return NanoBatchCounts(attn=n, dense=n // 2 if n >= 4 and n % 2 == 0 else n)


def apply_discrete_batching(engine_args: Any, cfg: Any) -> int | None:
    """Discrete batching (paper §4.2): the scheduler's token budget is the plan's profiled fast
    dense batch size, not vLLM's default. Called on `EngineArgs` before the engine config is built
    (P3, `wire_engine_args`); `cfg` is the parsed DisaggConfig. Explicit user values win:
    `max_num_batched_tokens` is only set when the user left it unset, and an explicit larger
    `max_num_seqs` raises the budget to it (vLLM needs budget >= max_num_seqs). Returns the budget
    set, or None (nanoflow off, no plan, no dense size in the plan, or the user chose)."""
    nanoflow = getattr(cfg, "nanoflow", None)
    if nanoflow is None or engine_args.max_num_batched_tokens is not None:
        return None
    if nanoflow.plan is None and nanoflow.num_nano_batches != "auto":
        return None  # an explicit count without a plan: nothing was profiled
    plan = resolve_plan(nanoflow.num_nano_batches, nanoflow.plan, str(engine_args.model))
    size = plan.dense_batch_size
    if not size:
        return None
    seqs = engine_args.max_num_seqs
    if seqs is None:
        engine_args.max_num_seqs = size  # decode batches are dense batches too
    elif seqs > size:
        logger.warning(
            "nanoflow: plan dense batch %d < max_num_seqs %d; using %d tokens per step", size, seqs, seqs
        )
        size = seqs
    engine_args.max_num_batched_tokens = size
    logger.info("nanoflow: discrete batching, max_num_batched_tokens=%d from the plan", size)
    return size
