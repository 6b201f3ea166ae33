# SPDX-License-Identifier: Apache-2.0
"""Lamina's model-attention disaggregation model (Lamina §2-3, §4.3, Tables 1, 3, 5).

DOP = (a, b): `a` compute devices hold the weights and run the non-attention
operators; `b` memory devices hold all KV caches and run attention.
MTIME/ATIME come from a roofline with the default efficiencies below, or from
a measured profile (`mtime` / `atime` curves, see profile.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec
from vllm_disagg.planner.profile import Profile


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak the roofline assumes (the "default H100/H20 profile")."""

    compute: float = 260 / 312
    """NanoFlow §6.2: CUTLASS reaches 260 of 312 TFLOPs at batch 2048."""
    memory: float = 0.70
    """Lamina §2.2.2: attention keeps >70% bandwidth utilisation."""


DEFAULT_EFFICIENCY = Efficiency()


# ------------------------------------------------------------ capacity
def kv_bytes_per_token(model: ModelSpec) -> float:
    """2·L·(d/G)·e bytes (Lamina §2.2.2)."""
    return model.kv_bytes_per_token


def requests_per_device(model: ModelSpec, device: HardwareSpec, context: int,
                        num_devices: int = 1, reserve_weights: bool = False) -> float:
    """Requests whose KV fits at `context` tokens ("about 30" on an H100 at 8192)."""
    free = num_devices * device.mem_gb * 1e9 - (model.weight_bytes if reserve_weights else 0)
    return max(0.0, free) / (context * kv_bytes_per_token(model))


def bytes_per_request_iteration(model: ModelSpec) -> float:
    """(2 + 2/G)·e·d·L: q, k, v out and the attention output back, per token."""
    g = model.r_gqa
    return (2 + 2 / g) * model.dtype_bytes * model.hidden_size * model.num_layers


# ------------------------------------------------------------ timings
def mtime(model: ModelSpec, dev: HardwareSpec, num_devices: int, batch: int,
          eff: Efficiency = DEFAULT_EFFICIENCY, profile: Profile | None = None) -> float:
    """Non-attention time of one decode iteration, seconds (§2.2.1 roofline)."""
    if profile is not None and profile.curve("mtime") is not None:
        return profile.curve("mtime")(batch) / 1e3
    flops = 2 * model.compute_params * batch
    nbytes = model.weight_bytes + 2 * model.dtype_bytes * batch * model.hidden_size * (
        model.num_layers)
    t_c = flops / (num_devices * dev.fp16_tflops * 1e12 * eff.compute)
    t_m = nbytes / (num_devices * dev.mem_bw_gbs * 1e9 * eff.memory)
    return max(t_c, t_m)


def atime(model: ModelSpec, dev: HardwareSpec, num_devices: int, batch: int, context: int,
          eff: Efficiency = DEFAULT_EFFICIENCY, profile: Profile | None = None) -> float:
    """Attention time of one decode iteration, seconds (BGEMV over the KV)."""
    curve = None if profile is None else profile.curve("atime")
    if curve is not None:
        scale = context / profile.atime_context_ref if profile.atime_context_ref else 1.0
        return curve(batch) * scale / 1e3
    kv = batch * context * kv_bytes_per_token(model)
    flops = 2 * model.r_gqa * kv / model.dtype_bytes
    t_m = kv / (num_devices * dev.mem_bw_gbs * 1e9 * eff.memory)
    t_c = flops / (num_devices * dev.fp16_tflops * 1e12 * eff.compute)
    return max(t_m, t_c)


@dataclass(frozen=True)
class Bandwidth:
    """Minimum interconnect bandwidth (§3.1), bytes/s."""

    total: float
    per_compute_device: float
    per_memory_device: float


def min_bandwidth(model: ModelSpec, compute: HardwareSpec, memory: HardwareSpec,
                  dop: tuple[int, int], batch: int, context: int, alpha: float = 0.2,
                  eff: Efficiency = DEFAULT_EFFICIENCY, profile: Profile | None = None) -> Bandwidth:
    """(2+2/G)·e·d·B·L / (α·[MTIME(B) + ATIME(B, l)])."""
    a, b = dop
    t = mtime(model, compute, a, batch, eff, profile) + atime(
        model, memory, b, batch, context, eff, profile)
    total = bytes_per_request_iteration(model) * batch / (alpha * t)
    return Bandwidth(total, total / a, total / b)


# ------------------------------------------------------- rotational pipeline
@dataclass(frozen=True)
class RotationPlan:
    """Steady state of n batches on n-1 model replicas (§4.3)."""

    num_batches: int
    period_s: float
    """Time for every batch to pass one (model slice + attention) step."""
    replica_utilization: float
    memory_utilization: float
    slices_per_s: float


def rotational_schedule(t_m: float, t_a: float, num_batches: int) -> RotationPlan:
    """Period = max(t_m + t_a, n·t_a, n·t_m/(n-1)); all three are equal (no
    bubbles anywhere) exactly when t_a = t_m/(n-1), Lamina's sizing rule."""
    n = num_batches
    if n < 2:
        raise ValueError("rotational pipelining needs at least 2 batches")
    period = max(t_m + t_a, n * t_a, n * t_m / (n - 1))
    return RotationPlan(n, period, n * t_m / ((n - 1) * period), n * t_a / period, n / period)


def replica_for(batch: int, slice_idx: int, num_batches: int) -> int:
    """Replica (1-based) running slice k of batch j: (j + k) mod (n-1) + 1."""
    return (batch + slice_idx) % (num_batches - 1) + 1


def best_num_batches(t_m: float, t_a_one_batch_all_devices: float, max_batches: int = 8) -> int:
    """Most batches that keep t_a <= t_m/(n-1): n = floor(t_m/t_a) + 1. Up to
    there each extra batch (and replica) fills memory-pool idle time (§4.3)."""
    if t_a_one_batch_all_devices <= 0:
        return max_batches
    n = math.floor(t_m / t_a_one_batch_all_devices + 1e-9) + 1
    return min(max_batches, max(2, n))


# ------------------------------------------------------------ DOP choice
@dataclass(frozen=True)
class DopEstimate:
    """One DOP (or a homogeneous TP baseline when memory is None)."""

    label: str
    cost_per_hour: float
    max_batch: int
    batch: int
    tbt_ms: float
    throughput_tok_s: float
    bandwidth_per_compute_gbs: float
    fits: bool

    @property
    def tok_per_dollar(self) -> float:
        return self.throughput_tok_s * 3600 / self.cost_per_hour if self.cost_per_hour else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tok_per_dollar": self.tok_per_dollar}


def dop_cost(compute: HardwareSpec, memory: HardwareSpec, dop: tuple[int, int]) -> float:
    """Hourly cost of DOP (a, b) from Lamina Table 1 prices."""
    return dop[0] * _price(compute) + dop[1] * _price(memory)


def _price(dev: HardwareSpec) -> float:
    if dev.price_per_hour is None:
        raise ValueError(f"no price for {dev.name} in the catalog")
    return dev.price_per_hour


def estimate_dop(model: ModelSpec, compute: HardwareSpec, memory: HardwareSpec,
                 dop: tuple[int, int], context: int, batch: int | None = None,
                 alpha: float = 0.2, eff: Efficiency = DEFAULT_EFFICIENCY,
                 profile: Profile | None = None) -> DopEstimate:
    """Batch = min(requested, what the b memory devices hold), split over
    n = replicas + 1 rotating batches (§4.3); a model slice includes sending
    its QKV over the compute devices' NICs. TBT = the rotation period."""
    a, b = dop
    tp = max(1, math.ceil(model.weight_bytes / (compute.mem_gb * 1e9)))
    replicas = a // tp
    max_b = int(requests_per_device(model, memory, context, b))
    bsz = max(1, min(batch or max_b, max_b))
    n = max(2, replicas + 1)
    per = math.ceil(bsz / n)
    t_net = bytes_per_request_iteration(model) * per / (tp * compute.nic_gbs * 1e9)
    t_m = mtime(model, compute, tp, per, eff, profile) + t_net
    t_a = atime(model, memory, b, per, context, eff, profile)
    plan = rotational_schedule(t_m, t_a, n)
    bw = min_bandwidth(model, compute, memory, dop, bsz, context, alpha, eff, profile)
    return DopEstimate(f"DOP=({a},{b})", dop_cost(compute, memory, dop), max_b, bsz,
                       1e3 * plan.period_s, n * per / plan.period_s,
                       bw.per_compute_device / 1e9, replicas >= 1 and max_b >= 1)


def baseline_devices(compute: HardwareSpec, budget_per_hour: float) -> int:
    """Homogeneous TP size of comparable cost: ceil(budget / price) (Table 5)."""
    return math.ceil(budget_per_hour / _price(compute) - 1e-9)


def estimate_baseline(model: ModelSpec, compute: HardwareSpec, num_devices: int, context: int,
                      batch: int | None = None, eff: Efficiency = DEFAULT_EFFICIENCY) -> DopEstimate:
    """vLLM with TP on `num_devices` compute GPUs: KV shares memory with weights."""
    max_b = int(requests_per_device(model, compute, context, num_devices, reserve_weights=True))
    bsz = max(1, min(batch or max_b, max_b))
    t = mtime(model, compute, num_devices, bsz, eff) + atime(model, compute, num_devices, bsz,
                                                             context, eff)
    return DopEstimate(f"TP={num_devices}x{compute.name}", num_devices * _price(compute), max_b,
                       bsz, 1e3 * t, bsz / t, 0.0, max_b >= 1)
