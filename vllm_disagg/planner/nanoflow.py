# SPDX-License-Identifier: Apache-2.0
"""NanoFlow's cost model (NanoFlow §3, Table 2, Eq. 1-9, Appendix A).

Per-op compute/memory/network for one iteration of a dense batch of
`dense_batch` tokens under tensor parallelism on `num_gpus` GPUs, the three
time estimates T_compute / T_mem / T_net, the verdict, the optimal
throughput `Compute / (2·P_Model)` and the KV-offload bandwidth.

More: README.md, "nanoflow.py".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec
from vllm_disagg.planner.profile import Profile

GIGA = 1e9


@dataclass(frozen=True)
class Workload:
    """NanoFlow §3.1 workload: dense batch B_Dense tokens, avg prompt p, output d."""

    dense_batch: int = 2048
    prompt_len: float = 512
    output_len: float = 1024

    @property
    def num_requests(self) -> float:
        """B_req from Eq. 2: B_Dense = B_req·(p+d)/(d+1)."""
        return self.dense_batch * (self.output_len + 1) / (self.prompt_len + self.output_len)

    @property
    def num_prefill_requests(self) -> float:
        return self.num_requests / (self.output_len + 1)

    @property
    def num_decode_requests(self) -> float:
        return self.num_requests * self.output_len / (self.output_len + 1)

    @property
    def num_prefill_tokens(self) -> float:
        return self.num_prefill_requests * self.prompt_len


@dataclass(frozen=True)
class OpCost:
    """One row of NanoFlow Table 2."""

    name: str
    gflop: float
    mem_gb: float
    net_gb: float
    t_compute_ms: float
    t_mem_ms: float
    t_net_ms: float
    measured_ms: float | None = None

    @property
    def bound(self) -> str:
        times = {"compute": self.t_compute_ms, "memory": self.t_mem_ms, "network": self.t_net_ms}
        return max(times, key=times.get)

    def to_dict(self) -> dict:
        return {**asdict(self), "bound": self.bound}


def gemm_costs(model: ModelSpec, dense_batch: float) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of KQV, O, UG, D for `dense_batch` tokens over all layers."""
    d, i_sz, L, e = model.hidden_size, model.intermediate_size, model.num_layers, model.dtype_bytes
    k = model.num_experts_per_tok
    shapes = {  # name: (K, N, weight multiplicity, compute multiplicity)
        "GEMM-KQV": (d, model.q_dim + 2 * model.kv_dim, 1, 1),
        "GEMM-O": (model.q_dim, d, 1, 1),
        "GEMM-UG": (d, 2 * i_sz, model.num_experts, k),
        "GEMM-D": (i_sz, d, model.num_experts, k),
    }
    out = {}
    for name, (kk, nn, w_mult, c_mult) in shapes.items():
        flops = 2 * dense_batch * kk * nn * L * c_mult
        act = dense_batch * c_mult * (kk + nn) * e * L
        out[name] = (flops, kk * nn * w_mult * e * L + act)
    return out


def attention_costs(model: ModelSpec, wl: Workload) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) of decode and prefill attention (Appendix A)."""
    L, e, d = model.num_layers, model.dtype_bytes, model.hidden_size
    kv_elems = wl.num_decode_requests * (wl.prompt_len + wl.output_len / 2) * 2 * model.kv_dim * L
    q_o = 2 * wl.num_decode_requests * model.q_dim * e * L
    decode = (2 * model.r_gqa * kv_elems, kv_elems * e + q_o)
    pre_flops = 4 * wl.num_prefill_requests * wl.prompt_len ** 2 * d * L
    pre_bytes = wl.num_prefill_tokens * (2 * model.q_dim + 2 * model.kv_dim) * e * L
    return {"Decode Attention": decode, "Prefill Attention": (pre_flops, pre_bytes)}


def network_costs(model: ModelSpec, dense_batch: float, num_gpus: int) -> tuple[float, float]:
    """(reduction FLOPs, bytes moved) of the per-layer 2 AG + 1 AR (Eq. 7)."""
    n = num_gpus - 1
    d, L = model.hidden_size, model.num_layers
    return 2 * n * dense_batch * d * L, 4 * dense_batch * d * model.dtype_bytes * L * n


def op_costs(model: ModelSpec, gpu: HardwareSpec, num_gpus: int, wl: Workload,
             tflops: float | None = None, profile: Profile | None = None) -> list[OpCost]:
    """All rows of Table 2 for one iteration; `profile.ops` fills `measured_ms`."""
    compute = num_gpus * (tflops or gpu.fp16_tflops) * 1e12
    membw = num_gpus * gpu.mem_bw_gbs * GIGA
    netbw = num_gpus * gpu.link_oneway_gbs * GIGA
    rows = {**gemm_costs(model, wl.dense_batch), **attention_costs(model, wl)}
    net_flops, net_bytes = network_costs(model, wl.dense_batch, num_gpus)
    out = []
    for name, (flops, nbytes) in rows.items():
        out.append(_row(name, flops, nbytes, 0.0, compute, membw, netbw, profile, wl))
    out.append(_row("Communication", net_flops, net_bytes, net_bytes, compute, membw, netbw,
                    profile, wl))
    return out


def _row(name, flops, nbytes, net, compute, membw, netbw, profile, wl) -> OpCost:
    measured = None
    if profile is not None and name in profile.ops:
        measured = profile.ops[name](wl.dense_batch)
    t_net = 1e3 * net / netbw if net else 0.0
    return OpCost(name, flops / GIGA, nbytes / GIGA, net / GIGA,
                  1e3 * flops / compute, 1e3 * nbytes / membw, t_net, measured)


@dataclass(frozen=True)
class IterationEstimate:
    """Totals of Table 2 plus the verdict and the throughputs they imply."""

    t_compute_ms: float
    t_mem_ms: float
    t_net_ms: float
    sequential_ms: float
    bound: str
    throughput_overlapped: float
    """tok/s if compute, memory and network fully overlap (NanoFlow's goal)."""
    throughput_sequential: float
    """tok/s if every op runs alone, one after the other."""


def iteration_estimate(rows: list[OpCost], dense_batch: float) -> IterationEstimate:
    """Sum the rows; the largest of the three totals bounds the iteration."""
    tc = sum(r.t_compute_ms for r in rows)
    tm = sum(r.t_mem_ms for r in rows)
    tn = sum(r.t_net_ms for r in rows)
    seq = sum(r.measured_ms if r.measured_ms is not None
              else max(r.t_compute_ms, r.t_mem_ms, r.t_net_ms) for r in rows)
    times = {"compute": tc, "memory": tm, "network": tn}
    bound = max(times, key=times.get)
    return IterationEstimate(tc, tm, tn, seq, bound, 1e3 * dense_batch / times[bound],
                             1e3 * dense_batch / seq)


# ----------------------------------------------------------- closed forms
def kv_capacity_elements(model: ModelSpec, gpu: HardwareSpec, num_gpus: int) -> float:
    """E_kv = MemSize/Dtype - P_Model (Appendix A)."""
    return num_gpus * gpu.mem_gb * GIGA / model.dtype_bytes - model.num_params


def max_requests(model: ModelSpec, gpu: HardwareSpec, num_gpus: int,
                 prompt_len: float, output_len: float) -> float:
    """B_req, Eq. 5: E_kv/(p + d/2) · R_GQA/(2·D_model·L)."""
    e_kv = kv_capacity_elements(model, gpu, num_gpus)
    return e_kv / (prompt_len + output_len / 2) * model.r_gqa / (
        2 * model.hidden_size * model.num_layers)


def t_mem_eq1(gpu: HardwareSpec) -> float:
    """T_mem = MemSize / MemBW in seconds (Eq. 1; N cancels)."""
    return gpu.mem_gb / gpu.mem_bw_gbs


def t_compute_eq6(model: ModelSpec, gpu: HardwareSpec, num_gpus: int,
                  prompt_len: float, output_len: float, tflops: float | None = None) -> float:
    """T_Compute at the largest batch that fits (Eq. 4 with Eq. 5), seconds."""
    b_req = max_requests(model, gpu, num_gpus, prompt_len, output_len)
    compute = num_gpus * (tflops or gpu.fp16_tflops) * 1e12
    return 2 * b_req * model.compute_params / compute * (prompt_len + output_len) / (
        output_len + 1)


def memory_compute_ratio(model: ModelSpec, gpu: HardwareSpec, num_gpus: int,
                         prompt_len: float, output_len: float, tflops: float | None = None) -> float:
    """T_R = T_mem / T_compute (Eq. 8): > 1 memory-bound, < 1 compute-bound."""
    return t_mem_eq1(gpu) / t_compute_eq6(model, gpu, num_gpus, prompt_len, output_len, tflops)


def verdict(t_r: float) -> str:
    return "memory-bound" if t_r > 1 else "compute-bound"


def optimal_throughput(model: ModelSpec, gpu: HardwareSpec, num_gpus: int = 1,
                       tflops: float | None = None) -> float:
    """Total tokens/s at the compute bound, Eq. 9: N·Compute / (2·P_Model).

    `tflops` overrides the catalog peak (NanoFlow §6.2 uses 260, CUTLASS's
    best at batch 2048). Divide by `num_gpus` for tok/s/GPU."""
    return num_gpus * (tflops or gpu.fp16_tflops) * 1e12 / (2 * model.compute_params)


def optimal_tokens_per_s(hf_config, dtype_bytes: int, peak_flops: float, tp: int = 1) -> float:
    """Eq. 9 for a running engine: its HF config, dtype and measured peak FLOP/s (the nano-batch
    runner's throughput log compares against it; `vllm_disagg.register()` passes it there)."""
    device = HardwareSpec(name="this-device", fp16_tflops=peak_flops / 1e12, mem_bw_gbs=0.0, mem_gb=0.0)
    return optimal_throughput(ModelSpec.from_hf(hf_config, dtype_bytes), device, num_gpus=tp)


def kv_offload_bandwidth(model: ModelSpec, throughput_tok_s: float) -> float:
    """Bytes/s to offload finished KV (§4.4): thr · 2·Dtype·D_model·L / R_GQA."""
    return throughput_tok_s * 2 * model.dtype_bytes * model.hidden_size * model.num_layers / (
        model.r_gqa)


def nano_batch_plan(dense_batch: int, num_gpus: int) -> dict[str, list[int]]:
    """NanoFlow §4.3 LLaMA-2-70B pipeline: KQV and decode attention in 4
    nano-batches, O/UGD/network in 2; one GPU (no network) uses 2 everywhere
    (§5.6 LLaMA-3-8B pipeline)."""
    def split(n: int) -> list[int]:
        base, rem = divmod(dense_batch, n)
        return [base + (i < rem) for i in range(n)]
    if num_gpus == 1:
        return {op: split(2) for op in ("KQV", "Attention", "O", "UGD")}
    return {"KQV": split(4), "DecodeAttention": split(4), "O": split(2), "UGD": split(2),
            "Network": split(2)}
