# SPDX-License-Identifier: Apache-2.0
"""`num_nano_batches: "auto"`: split a step into nano-batches only where that is predicted to pay.

Nano-batching gains only where ops with different bottlenecks overlap; every split step pays the fixed
per-op cost, and memory-bound GEMMs read their weights, once per nano-batch. On CPU the executor
serialises vLLM's attention and GEMM kernels (they share one scratch pad, executor.CPU_KERNEL_LOCK),
so only network-bound ops overlap there (remote attention at pipeline depth 2, TP all-reduce). "auto":
- a tuned plan (`vllm-disagg tune`, its search always lets n=1 compete): its counts, on steps of at
  least `plan.break_even_tokens` tokens (`break_even_tokens` below, from the plan's own cost model);
- no plan: n=1 (vLLM's plain forward, the runner stays inert) unless a network-bound op exists;
  with one, 2 nano-batches on steps of at least DEFAULT_NETWORK_BREAK_EVEN tokens.
Steps below the break-even run vLLM's plain forward (`nanoflow_stats()["plain_steps"]`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vllm_disagg.config import disagg_config_from_vllm
from vllm_disagg.nanoflow.autosearch import CostFn, evaluate
from vllm_disagg.nanoflow.graph import ATTN, DENSE, NET, PipelineSpec

MIN_GAIN = 0.03
"""A split must be predicted at least this much faster than the whole step to be chosen."""
DEFAULT_NETWORK_BREAK_EVEN = 16
"""Without a tuned plan, with a network-bound op: the smallest step (tokens) that is split. From
benchmarks/nano_bench.py's remote-attention batch sweep (nano_auto_vs_plain_by_batch_remote)."""


def plain_spec(num_layers: int, tensor_parallel: bool = False) -> PipelineSpec:
    """The whole step as one nano-batch on one unit: what vLLM's plain forward does."""
    return PipelineSpec(num_layers, 1, 1, tensor_parallel, attn_unit=DENSE, net_unit=DENSE)


def nano_spec(num_layers: int, num_attn_batches: int, num_dense_batches: int, inline: bool, tensor_parallel: bool = False,
              attention_remote: bool = False) -> PipelineSpec:
    """A plan's pipeline, as autosearch builds its candidates."""
    if inline:
        return PipelineSpec(num_layers, num_attn_batches, num_dense_batches, tensor_parallel, attn_unit=DENSE, net_unit=DENSE)
    return PipelineSpec(num_layers, num_attn_batches, num_dense_batches, tensor_parallel, attn_unit=NET if attention_remote else ATTN)


def break_even_tokens(cost: CostFn, num_layers: int, num_attn_batches: int, num_dense_batches: int, shares: dict[str, int],
                      grid: Sequence[int], inline: bool = False, tensor_parallel: bool = False,
                      attention_remote: bool = False, serial: Collection[str] = ()) -> int | None:
    """The smallest step size of `grid` from which the split (num_attn_batches/num_dense_batches on `shares`) is
    predicted at least MIN_GAIN faster than the whole step, at that size and every larger one of
    `grid`; None when it never is (then "auto" never splits)."""
    if num_attn_batches < 2:
        return None
    budget = max(1, sum(shares.values()) or 1)
    nano = nano_spec(num_layers, num_attn_batches, num_dense_batches, inline, tensor_parallel, attention_remote)
    whole = plain_spec(num_layers, tensor_parallel)
    best = None
    for tokens in sorted(grid, reverse=True):
        if tokens < num_attn_batches:
            break
        split_s = evaluate(nano, tokens, shares or {DENSE: budget}, cost, serial=serial).makespan
        whole_s = evaluate(whole, tokens, {DENSE: budget}, cost).makespan
        if split_s > whole_s * (1 - MIN_GAIN):
            break
        best = tokens
    return best


def has_network_op(vllm_config) -> bool:
    """A network-bound op the executor can overlap: remote attention at pipeline depth 2 (the
    composed worker's default) or a TP all-reduce."""
    cfg = disagg_config_from_vllm(vllm_config)
    remote_attention = cfg.remote_attention if cfg is not None else None
    remote = (remote_attention is not None and bool(remote_attention.servers)
              and ("pipeline" not in remote_attention.model_fields_set or remote_attention.pipeline >= 2))
    return remote or vllm_config.parallel_config.tensor_parallel_size > 1
