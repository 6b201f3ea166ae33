# SPDX-License-Identifier: Apache-2.0
"""Rotational staggered pipelining (Lamina section 4.3): who runs what, when.

n batches share n-1 model replicas and one pool of attention devices. Time is counted in units
of one attention operator, t_a = t_m / (n-1), so a model slice takes n-1 units. Batch j starts
at time j; its slice k starts at j + k*n on replica (j + k) mod (n-1) + 1, and its attention k
occupies the attention pool during [j + k*n + n-1, j + k*n + n). Every start time t has exactly
one (j < n, k) with t = j + k*n, and t = j + k (mod n-1), which is why the schedule is
conflict-free and bubble-free; `check_*` verify it by enumeration. n = 2 is ping-pong on one
replica (no context migration).
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_POOL = 0  # device id of the shared attention devices; replicas are 1..n-1


@dataclass(frozen=True)
class Op:
    kind: str  # "model" (slice k) or "attn" (attention operator k)
    batch: int
    index: int
    device: int
    start: int
    end: int


def replica_for(batch: int, slice_index: int, n: int) -> int:
    """The paper's rule: slice k of batch j runs on replica (j + k) mod (n - 1) + 1."""
    if n < 2:
        raise ValueError(f"rotational pipelining needs n >= 2 batches, got {n}")
    return (batch + slice_index) % (n - 1) + 1


def rotational_schedule(n: int, num_attn: int) -> list[Op]:
    """All ops of n batches through num_attn attention layers (num_attn + 1 model slices)."""
    if num_attn < 1:
        raise ValueError(f"need at least one attention layer, got {num_attn}")
    ops: list[Op] = []
    for j in range(n):
        for k in range(num_attn + 1):
            start = j + k * n
            ops.append(Op("model", j, k, replica_for(j, k, n), start, start + n - 1))
            if k < num_attn:
                a = start + n - 1
                ops.append(Op("attn", j, k, ATTENTION_POOL, a, a + 1))
    return sorted(ops, key=lambda o: (o.start, o.device))


def check_conflict_free(ops: list[Op]) -> None:
    """No device runs two ops at once, and each batch's ops run in order, one at a time."""
    for key, group in _group(ops, lambda o: o.device).items():
        _check_disjoint(group, f"device {key}")
    for key, group in _group(ops, lambda o: o.batch).items():
        _check_disjoint(group, f"batch {key}")
        order = sorted(group, key=lambda o: o.start)
        expect = [("model", 0)]
        for _ in order[1:]:
            prev_kind, prev_idx = expect[-1]
            expect.append(("attn", prev_idx) if prev_kind == "model" else ("model", prev_idx + 1))
        if [(o.kind, o.index) for o in order] != expect:
            raise AssertionError(f"batch {key} runs out of order")


def check_bubble_free(ops: list[Op], n: int) -> None:
    """In steady state (every device started, no batch drained) every device is busy.

    The pool's first op starts at n-1; batch 0 runs its last attention at num_attn*n - 1, so the
    window [n-1, num_attn*n + n-1) is where every device must be busy.
    """
    num_attn = max(o.index for o in ops if o.kind == "attn") + 1
    lo, hi = n - 1, num_attn * n + n - 1
    if hi <= lo:
        raise AssertionError(f"schedule too short to have a steady state: [{lo}, {hi})")
    for dev, group in _group(ops, lambda o: o.device).items():
        busy = set()
        for op in group:
            busy.update(range(op.start, op.end))
        idle = [t for t in range(lo, hi) if t not in busy]
        if idle:
            raise AssertionError(f"device {dev} idle at {idle[:5]}")


def _group(ops, key) -> dict:
    out: dict = {}
    for op in ops:
        out.setdefault(key(op), []).append(op)
    return out


def _check_disjoint(group: list[Op], what: str) -> None:
    order = sorted(group, key=lambda o: o.start)
    for a, b in zip(order, order[1:]):
        if b.start < a.end:
            raise AssertionError(f"{what}: {a} overlaps {b}")
