# SPDX-License-Identifier: Apache-2.0
"""NanoFlow's cost model against the paper's own Table 2, Eq. 8-9 and §4.4."""

import pytest

from vllm_disagg.planner import nanoflow as nf
from vllm_disagg.planner.catalog import get_hardware, get_model
from vllm_disagg.planner.profile import parse_profile

LLAMA2_70B = get_model("llama-2-70b")
A100 = get_hardware("a100-80g")
TABLE2_WL = nf.Workload(dense_batch=2048, prompt_len=512, output_len=1024)


@pytest.fixture(scope="module")
def table2():
    rows = nf.op_costs(LLAMA2_70B, A100, 8, TABLE2_WL)
    return {r.name: r for r in rows}, nf.iteration_estimate(rows, 2048)


@pytest.mark.parametrize("name,gflop", [("GEMM-KQV", 27487.8), ("GEMM-O", 21990.2),
                                        ("GEMM-UG", 153931.6), ("GEMM-D", 76965.8)])
def test_gemm_gflop_match_table2_within_a_tenth_of_a_percent(table2, name, gflop):
    assert table2[0][name].gflop == pytest.approx(gflop, rel=1e-3)


@pytest.mark.parametrize("name,mem_gb,t_c,t_m", [
    ("GEMM-KQV", 19.5, 11.01, 1.22), ("GEMM-O", 16.1, 8.81, 1.01),
    ("GEMM-UG", 96.6, 61.67, 6.04), ("GEMM-D", 49.7, 30.84, 3.11),
    ("Decode Attention", 462.2, 1.47, 28.89), ("Prefill Attention", 2.1, 0.37, 0.13),
])
def test_every_row_of_table2_matches_its_memory_and_times(table2, name, mem_gb, t_c, t_m):
    row = table2[0][name]
    assert row.mem_gb == pytest.approx(mem_gb, rel=0.05)
    assert row.t_compute_ms == pytest.approx(t_c, rel=0.01, abs=0.006)
    assert row.t_mem_ms == pytest.approx(t_m, rel=0.05, abs=0.006)


def test_communication_row_moves_75_gb_and_takes_31_ms_on_one_way_nvlink(table2):
    comm = table2[0]["Communication"]
    assert comm.net_gb == pytest.approx(75.2, rel=2e-3)
    assert comm.mem_gb == pytest.approx(75.2, rel=2e-3)
    assert comm.gflop == pytest.approx(18.8, rel=5e-3)
    assert comm.t_net_ms == pytest.approx(31.33, rel=1e-3)
    assert comm.bound == "network"


def test_totals_match_table2_within_one_percent_and_the_iteration_is_compute_bound(table2):
    _, est = table2
    assert est.t_compute_ms == pytest.approx(114.17, rel=0.01)
    assert est.t_mem_ms == pytest.approx(45.09, rel=0.01)
    assert est.t_net_ms == pytest.approx(31.33, rel=0.01)
    assert est.bound == "compute"


def test_measured_op_times_from_a_profile_fill_the_measured_column():
    prof = parse_profile({"ops": {"GEMM-KQV": [{"num_tokens": 2048, "ms": 16.08}],
                                  "GEMM-UG": [{"num_tokens": 1024, "ms": 35.0},
                                              {"num_tokens": 2048, "ms": 69.92}]}})
    rows = {r.name: r for r in nf.op_costs(LLAMA2_70B, A100, 8, TABLE2_WL, profile=prof)}
    assert rows["GEMM-KQV"].measured_ms == pytest.approx(16.08)
    assert rows["GEMM-UG"].measured_ms == pytest.approx(69.92)
    assert rows["GEMM-O"].measured_ms is None


def test_optimal_throughput_is_17828_tokens_per_second_on_8_a100():
    assert nf.optimal_throughput(LLAMA2_70B, A100, 8) == pytest.approx(17828, abs=1)


def test_optimal_throughput_at_cutlass_260_tflops_is_1857_per_gpu():
    assert nf.optimal_throughput(LLAMA2_70B, A100, 8, tflops=260) / 8 == pytest.approx(1857, abs=1)


@pytest.mark.parametrize("model,per_gpu", [("llama-3-70b", 1841), ("qwen2-72b", 1788),
                                           ("deepseek-67b", 1929), ("llama-3-8b", 16189)])
def test_optimal_throughput_of_ported_models_follows_eq9(model, per_gpu):
    assert nf.optimal_throughput(get_model(model), A100, 1, tflops=260) == pytest.approx(
        per_gpu, rel=2e-3)


def test_optimal_throughput_does_not_depend_on_memory_or_lengths():
    other = get_hardware("a100-40g")
    assert nf.optimal_throughput(LLAMA2_70B, other, 8) == nf.optimal_throughput(LLAMA2_70B, A100, 8)


def test_dense_batch_and_request_count_follow_eq2():
    wl = nf.Workload(2048, 512, 1024)
    assert wl.num_requests == pytest.approx(2048 * 1025 / 1536)
    assert wl.num_prefill_requests + wl.num_decode_requests == pytest.approx(wl.num_requests)


@pytest.mark.parametrize("name,n,expect", [
    ("llama-2-70b", 8, [0.091, 0.069, 0.108]),
    ("mistral-7b", 1, [0.34, 0.25, 0.40]),
])
def test_eq8_ratio_reproduces_the_compute_bound_workloads_of_fig2(name, n, expect):
    model = get_model(name)
    got = [nf.memory_compute_ratio(model, A100, n, p, d)
           for p, d in [(1155, 211), (102, 222), (246, 322)]]
    assert got == pytest.approx(expect, rel=0.03)
    assert all(nf.verdict(t) == "compute-bound" for t in got)


def test_only_llama2_7b_on_one_gpu_is_memory_bound():
    model = get_model("llama-2-7b")
    t_r = [nf.memory_compute_ratio(model, A100, 1, p, d) for p, d in [(1155, 211), (246, 322)]]
    assert all(nf.verdict(t) == "memory-bound" for t in t_r)


def test_kv_offload_needs_5_4_gib_per_second_at_optimal_throughput():
    bw = nf.kv_offload_bandwidth(LLAMA2_70B, 17828)
    assert bw / 2**30 == pytest.approx(5.44, abs=0.01)
    assert bw < 2 * 3e9  # "two SSDs" at 3 GB/s each suffice


@pytest.mark.parametrize("gpu,ratio", [("v100", 139), ("a100-40g", 200), ("a100-80g", 156),
                                       ("h100", 295), ("h200", 206), ("b100", 225),
                                       ("b200", 281), ("mi300", 246)])
def test_catalog_reproduces_nanoflow_table1_compute_to_bandwidth_ratios(gpu, ratio):
    hw = get_hardware(gpu)
    assert hw.fp16_tflops * 1e3 / hw.mem_bw_gbs == pytest.approx(ratio, abs=1)


def test_nano_batch_plan_splits_kqv_and_attention_in_four_and_the_rest_in_two():
    plan = nf.nano_batch_plan(2048, 8)
    assert plan["KQV"] == [512] * 4 and plan["DecodeAttention"] == [512] * 4
    assert plan["UGD"] == [1024, 1024] and plan["Network"] == [1024, 1024]
    assert all(sum(v) == 2000 for v in nf.nano_batch_plan(2000, 1).values())


def test_a_single_gpu_has_no_network_cost():
    rows = {r.name: r for r in nf.op_costs(get_model("llama-3-8b"), A100, 1, TABLE2_WL)}
    assert rows["Communication"].net_gb == 0 and rows["Communication"].t_net_ms == 0
