# SPDX-License-Identifier: Apache-2.0
"""The per-step op graph of the NanoFlow pipeline, and its list schedule.

One structure serves both the executor (which runs the ops in the scheduled per-unit order) and
the autosearch (which estimates the step time of a candidate plan from profiled op costs). Keeping
them on one graph is what makes the searched plan the plan that runs. More: README.md, "graph.py".

Per decoder layer `l`, with `n_attn` fine nano-batches `a` and `n_dense` coarse nano-batches `b`
(`n_attn % n_dense == 0`, coarse `b` = fine `[b*k, (b+1)*k)`):

    kqv[l,a] -> attn[l,a] -> o[l,b] -> (ar_o[l,b]) -> ugd[l,b] -> (ar_d[l,b]) -> kqv[l+1,a]
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

OpKey = tuple[str, int, int]  # (op name, layer, nano-batch index within the op's group)

DENSE, ATTN, NET = "dense", "attn", "net"
FINE_OPS = ("kqv", "attn")
COARSE_OPS = ("o", "ar_o", "ugd", "ar_d")
_SERIAL = "\0serial"  # the shared resource of `serial` units in list_schedule


@dataclass(frozen=True)
class PipelineSpec:
    """Shape of one step's pipeline: what the graph is built from."""

    num_layers: int
    num_attn_batches: int
    num_dense_batches: int
    tensor_parallel: bool = False
    attn_unit: str = ATTN
    net_unit: str = NET

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_attn_batches < 1 or self.num_dense_batches < 1:
            raise ValueError(f"layers and nano-batch counts must be >= 1, got {self}")
        if self.num_attn_batches % self.num_dense_batches:
            raise ValueError(
                f"num_attn_batches ({self.num_attn_batches}) must be a multiple of num_dense_batches ({self.num_dense_batches}): "
                "coarse nano-batches are unions of fine ones"
            )

    @property
    def ratio(self) -> int:
        return self.num_attn_batches // self.num_dense_batches


@dataclass(frozen=True)
class OpNode:
    name: str
    layer: int
    nb: int
    unit: str
    deps: tuple[OpKey, ...] = ()

    @property
    def key(self) -> OpKey:
        return (self.name, self.layer, self.nb)


def build_graph(spec: PipelineSpec) -> list[OpNode]:
    """All ops of one step, in a canonical topological order (layer by layer)."""
    nodes: list[OpNode] = []
    for layer in range(spec.num_layers):
        nodes += _layer_nodes(spec, layer)
    return nodes


def _layer_nodes(spec: PipelineSpec, layer: int) -> list[OpNode]:
    k, tp = spec.ratio, spec.tensor_parallel
    prev_out = "ar_d" if tp else "ugd"
    nodes = []
    for a in range(spec.num_attn_batches):
        deps = ((prev_out, layer - 1, a // k),) if layer else ()
        nodes.append(OpNode("kqv", layer, a, DENSE, deps))
    for a in range(spec.num_attn_batches):
        # a prefill split across slices reads KV that the previous slice wrote
        deps = (("kqv", layer, a),) + ((("attn", layer, a - 1),) if a else ())
        nodes.append(OpNode("attn", layer, a, spec.attn_unit, deps))
    for b in range(spec.num_dense_batches):
        nodes.append(OpNode("o", layer, b, DENSE, tuple(("attn", layer, a) for a in range(b * k, b * k + k))))
        o_out = ("o", layer, b)
        if tp:
            nodes.append(OpNode("ar_o", layer, b, spec.net_unit, (o_out,)))
            o_out = ("ar_o", layer, b)
        nodes.append(OpNode("ugd", layer, b, DENSE, (o_out,)))
        if tp:
            nodes.append(OpNode("ar_d", layer, b, spec.net_unit, (("ugd", layer, b),)))
    return nodes


@dataclass
class Schedule:
    """A list schedule: per-unit op order plus simulated start/finish times."""

    order: dict[str, list[OpKey]]
    start: dict[OpKey, float]
    finish: dict[OpKey, float]
    binding: dict[OpKey, OpKey | None] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.finish.values(), default=0.0)

    def global_order(self) -> list[OpKey]:
        """All ops by simulated start time: a valid sequential (inline) order."""
        return sorted(self.start, key=lambda key: (self.start[key], self.finish[key]))


def list_schedule(
    nodes: Iterable[OpNode], cost: Callable[[OpNode], float], serial: Collection[str] = ()
) -> Schedule:
    """Greedy list scheduling, one op at a time per unit (a unit is a stream).

    Units in `serial` also run one op at a time among themselves (CPU: vLLM's attention and GEMM
    kernels share a scratchpad, see executor.CPU_KERNEL_LOCK), so the simulated step and the
    search see that they cannot overlap.

    Among ready ops, the one that can start earliest goes first; ties go to canonical order. The
    per-unit orders are consistent with one global start-time order, so running them on unit
    threads with dependency waits cannot deadlock.
    """
    nodes = list(nodes)
    index = {n.key: i for i, n in enumerate(nodes)}
    by_key = {n.key: n for n in nodes}
    users: dict[OpKey, list[OpKey]] = {n.key: [] for n in nodes}
    missing = {n.key: 0 for n in nodes}
    for n in nodes:
        for d in n.deps:
            if d not in by_key:
                raise ValueError(f"op {n.key} depends on unknown op {d}")
            users[d].append(n.key)
            missing[n.key] += 1
    unit_free: dict[str, float] = {}
    unit_last: dict[str, OpKey | None] = {}
    sched = Schedule(order={}, start={}, finish={})
    data_ready = {k: 0.0 for k, m in missing.items() if m == 0}
    ready = [(0.0, index[k], k) for k in data_ready]
    heapq.heapify(ready)
    while ready:
        est, _, key = heapq.heappop(ready)
        node = by_key[key]
        res = _SERIAL if node.unit in serial else node.unit
        start = max(data_ready[key], unit_free.get(res, 0.0))
        if start > est:
            # lazy re-evaluation: the unit got busy since this entry was pushed
            heapq.heappush(ready, (start, index[key], key))
            continue
        sched.start[key] = start
        sched.finish[key] = start + max(0.0, float(cost(node)))
        sched.binding[key] = _binding_pred(node, sched, unit_last.get(res), start)
        sched.order.setdefault(node.unit, []).append(key)
        unit_free[res] = sched.finish[key]
        unit_last[res] = key
        for user in users[key]:
            missing[user] -= 1
            if missing[user] == 0:
                data_ready[user] = max(sched.finish[d] for d in by_key[user].deps)
                heapq.heappush(ready, (data_ready[user], index[user], user))
    if len(sched.start) != len(nodes):
        raise ValueError("op graph has a cycle")
    return sched


def _binding_pred(node: OpNode, sched: Schedule, unit_prev: OpKey | None, start: float) -> OpKey | None:
    """The predecessor (data or same-unit) whose finish fixed this op's start."""
    cands = list(node.deps) + ([unit_prev] if unit_prev else [])
    best = max(cands, key=lambda k: sched.finish[k], default=None)
    if best is None or sched.finish[best] < start - 1e-12:
        return None
    return best


def critical_path(sched: Schedule) -> list[OpKey]:
    """The chain of ops (data and unit-order edges) that ends last: shorten these to win."""
    if not sched.finish:
        return []
    key: OpKey | None = max(sched.finish, key=lambda k: sched.finish[k])
    path = []
    while key is not None:
        path.append(key)
        key = sched.binding.get(key)
    return path[::-1]
