# SPDX-License-Identifier: Apache-2.0
"""`nano_batches: "auto"` splits a step only above the break-even its cost model predicts (fake profiles)."""

from __future__ import annotations

from vllm_disagg.nanoflow.auto import (
    DEFAULT_NETWORK_BREAK_EVEN,
    MIN_GAIN,
    break_even_tokens,
    nano_spec,
    plain_spec,
)
from vllm_disagg.nanoflow.autosearch import evaluate
from vllm_disagg.nanoflow.graph import ATTN, DENSE, NET
from vllm_disagg.nanoflow.plan import resolve_plan

GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
WEIGHTS_S = {"kqv": 60e-6, "o": 30e-6, "ugd": 200e-6}  # reading an op's weights: once per nano-batch


def remote_profile(weights_scale: float = 1.0):
    """Dense ops: weight-bound (a fixed read per call) plus a little per token; remote attention: a
    round trip plus the server's kernel over each request's context, on the net unit, where it
    overlaps the other nano-batch's dense ops."""
    def cost(op: str, tokens: int, share: int) -> float:
        if op == "attn":
            return 80e-6 + 60e-6 * tokens
        return WEIGHTS_S[op] * weights_scale + 2e-6 * tokens
    return cost


def local_cpu_profile(op: str, tokens: int, share: int) -> float:
    """Everything on the cores; attention and GEMMs cannot overlap (CPU_KERNEL_LOCK)."""
    return (80e-6 + 30e-6 * tokens) if op == "attn" else WEIGHTS_S[op] + 2e-6 * tokens


def _step_s(cost, tokens: int, n: int) -> float:
    if n == 1:
        return evaluate(plain_spec(4), tokens, {DENSE: 1}, cost).makespan
    return evaluate(nano_spec(4, n, n, inline=False, attention_remote=True), tokens, {DENSE: 1, NET: 0}, cost).makespan


def _break_even(cost) -> int | None:
    return break_even_tokens(cost, 4, 2, 2, {DENSE: 1, NET: 0}, GRID, attention_remote=True)


def test_auto_splits_only_from_the_break_even_batch_up_with_a_network_op():
    cost = remote_profile()
    tokens = _break_even(cost)
    assert tokens is not None and 2 < tokens < 512  # small steps: the second weight read is not won back
    for t in (t for t in GRID if t >= tokens):
        assert _step_s(cost, t, 2) <= _step_s(cost, t, 1) * (1 - MIN_GAIN)
    below = max(t for t in GRID if t < tokens)
    assert _step_s(cost, below, 2) > _step_s(cost, below, 1) * (1 - MIN_GAIN)


def test_auto_never_splits_where_nothing_can_overlap():
    serial = (DENSE, ATTN)
    assert break_even_tokens(local_cpu_profile, 4, 2, 2, {DENSE: 1, ATTN: 1}, GRID, serial=serial) is None
    assert break_even_tokens(local_cpu_profile, 4, 2, 2, {DENSE: 1}, GRID, inline=True) is None
    assert break_even_tokens(remote_profile(), 4, 1, 1, {DENSE: 1}, GRID) is None  # n=1 plan


def test_auto_without_a_plan_is_n1_unless_a_network_op_can_overlap(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DISAGG_CACHE", str(tmp_path))  # no tuned plan on disk
    plain = resolve_plan("auto", None, "some-model", network_op=False)
    assert plain.nano_batches.attn == 1 and plain.break_even_tokens is None
    remote = resolve_plan("auto", None, "some-model", network_op=True)
    assert remote.nano_batches.attn == 2 and remote.break_even_tokens == DEFAULT_NETWORK_BREAK_EVEN
    assert resolve_plan(2, None, "some-model").break_even_tokens is None  # an explicit count splits every step
