# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up ... --tensor-parallel-size N`: each P/D instance gets N consecutive free KV ports
(rank r serves on kv_port + r, where the other side's rank r finds it) and one core list per rank."""

from __future__ import annotations

import socket

import pytest
from test_ray_launch import up_args

from vllm_disagg.cli.main import build_parser
from vllm_disagg.launch.cli import plan_from_args
from vllm_disagg.launch.instances import (
    free_port_runs,
    instance_env,
    parse_cores,
    rank_core_slices,
    tensor_parallel_size,
)
from vllm_disagg.launch.ray.specs import plan_actor_specs


@pytest.mark.parametrize("argv, size", [
    ([], 1), (["--dtype", "float32"], 1), (["--tensor-parallel-size", "2"], 2),
    (["--tensor-parallel-size=4", "--enforce-eager"], 4), (["-tp", "2"], 2), (["--tensor_parallel_size", "3"], 3),
])
def test_the_tp_size_is_read_from_the_arguments_up_passes_to_vllm(argv, size):
    assert tensor_parallel_size(argv) == size


@pytest.mark.parametrize("argv", [["-tp", "0"], ["--tensor-parallel-size", "two"], ["-tp"]])
def test_a_bad_tp_size_is_refused_by_name(argv):
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        tensor_parallel_size(argv)


def test_port_runs_are_free_consecutive_and_disjoint():
    bases = free_port_runs([1, 1, 2, 2])
    ports = [bases[0], bases[1], bases[2], bases[2] + 1, bases[3], bases[3] + 1]
    assert len(set(ports)) == len(ports)
    socks = []
    try:
        for port in ports:  # every port of every run binds: free, and not handed out twice
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in socks:
            s.close()


def test_each_rank_gets_its_cores_or_the_ranks_of_an_instance_share_its_slice():
    assert rank_core_slices(2, 1, 2, cores=[0, 1, 2, 3]) == ["0|1", "2|3"]
    assert rank_core_slices(2, 2, 2, cores=list(range(8))) == ["0,1|2,3", "4,5|6,7"]
    # two cores for two TP=2 engines: each engine keeps a core (as test_pd_tp.py runs them)
    assert rank_core_slices(2, 1, 2, cores=[0, 1]) == ["0|0", "1|1"]
    assert rank_core_slices(3, 1, 1, cores=[0, 1]) == ["0", "1", "0"]  # TP=1: core_slices as before
    assert parse_cores("0|1") == {0, 1} and parse_cores("0,1|2,3") == {0, 1, 2, 3}


def test_up_at_tp2_plans_kv_port_runs_and_per_rank_cores():
    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2"])
    p, d = plan_from_args(args)
    assert p.kv_port != d.kv_port and abs(p.kv_port - d.kv_port) >= 2
    assert len(p.cores.split("|")) == len(d.cores.split("|")) == 2
    assert instance_env(p, 1, base={})["VLLM_CPU_OMP_THREADS_BIND"] == p.cores
    mixed = plan_from_args(build_parser().parse_args(["up", "--prefill", "0", "--decode", "0", "-tp", "2"]))
    assert [(s.role, len(s.cores.split("|"))) for s in mixed] == [("mixed", 2)]


def test_tp_with_remote_attention_or_on_ray_is_refused_with_one_line():
    with pytest.raises(ValueError, match="remote attention runs at TP=1"):
        plan_from_args(build_parser().parse_args(["up", "--attention", "2", "--tensor-parallel-size", "2"]))
    with pytest.raises(ValueError, match="--backend local only"):
        plan_actor_specs(up_args("--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2"), "/m")
