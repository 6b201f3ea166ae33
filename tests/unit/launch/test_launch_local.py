# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up` planning: ports, cores, instance command lines and argument pass-through."""

from __future__ import annotations

import json

import pytest

from vllm_disagg.cli.main import build_parser
from vllm_disagg.launch.local import core_slices, plan_instances, serve_command


def test_one_prefill_one_decode_get_distinct_ports_kv_ports_and_cores():
    specs = plan_instances(1, 1, 0, ports=[8100, 8200, 9100, 9200])
    assert [(s.role, s.http_port, s.kv_port) for s in specs] == [("prefill", 8100, 9100), ("decode", 8200, 9200)]
    auto = plan_instances(2, 2, 1)
    ports = [s.http_port for s in auto] + [s.kv_port for s in auto if s.kv_port]
    assert len(set(ports)) == len(ports) == 9
    assert [s.name for s in auto] == ["prefill0", "prefill1", "decode0", "decode1", "mixed0"]


def test_no_pools_means_one_plain_instance_and_prefill_alone_is_refused():
    specs = plan_instances(0, 0, 0)
    assert [(s.role, s.kv_port) for s in specs] == [("mixed", None)]
    with pytest.raises(ValueError, match="--decode"):
        plan_instances(1, 0, 0)


def test_cores_are_dealt_round_robin_and_wrap_on_small_machines():
    assert core_slices(2, 1, cores=[0, 1]) == ["0", "1"]
    assert core_slices(3, 1, cores=[0, 1]) == ["0", "1", "0"]
    assert core_slices(2, 2, cores=[0, 1, 2, 3]) == ["0,1", "2,3"]
    assert core_slices(1, 4, cores=[0, 1]) == ["0,1"]


def test_prefill_and_decode_get_the_connector_with_recompute_and_their_kv_port():
    p, d, m = plan_instances(1, 1, 1, ports=[1, 2, 3, 11, 12])
    cmd = serve_command(p, "/m", "shm", ["--dtype", "float32"], served_name="tiny", vllm_cmd=["vllm", "serve"])
    assert cmd[:7] == ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "1"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "DisaggConnector", "kv_connector_module_path": "vllm_disagg.kv.connector",
                  "kv_role": "kv_producer", "kv_load_failure_policy": "recompute"}
    extra = json.loads(cmd[cmd.index("--additional-config") + 1])
    assert extra == {"disagg": {"role": "prefill", "kv": {"kv_port": 11, "transport": "shm"}}}
    assert cmd[-2:] == ["--dtype", "float32"] and cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert cmd[cmd.index("--middleware") + 1] == "vllm_disagg.liveness.LiveMiddleware"  # GET /live
    d_cmd = serve_command(d, "/m", "tcp", [], vllm_cmd=["vllm", "serve"])
    assert json.loads(d_cmd[d_cmd.index("--kv-transfer-config") + 1])["kv_role"] == "kv_consumer"
    assert "--kv-transfer-config" not in serve_command(m, "/m", "tcp", [], vllm_cmd=["vllm", "serve"])


def test_unknown_arguments_of_up_are_kept_for_vllm_in_order():
    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "2", "--dtype", "float32",
                                      "--max-model-len=1024", "--enforce-eager", "--transport", "shm"])
    assert (args.prefill, args.decode, args.transport) == (1, 2, "shm")
    assert args.vllm_args == ["--dtype", "float32", "--max-model-len=1024", "--enforce-eager"]


def test_router_command_parses_pool_membership():
    args = build_parser().parse_args(["router", "--prefill", "http://a:1", "--prefill-kv", "a:9",
                                      "--decode", "http://b:2", "--decode", "http://c:3", "--port", "9000"])
    from vllm_disagg.router.cli import config_from_args

    cfg = config_from_args(args)
    assert cfg.decode_urls == ["http://b:2", "http://c:3"] and args.port == 9000


def test_instance_env_pins_cores_and_sizes_the_kv_cache_or_leaves_it_to_vllm_flags():
    from vllm_disagg.launch.local import InstanceSpec, instance_env

    spec = InstanceSpec("decode", 0, 1, 2, "1", env={"UCX_NET_DEVICES": "lo"})
    env = instance_env(spec, 2, base={"VLLM_CPU_KVCACHE_SPACE": "9", "PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["UCX_NET_DEVICES"] == "lo" and env["PATH"] == "/bin"
    assert "VLLM_CPU_KVCACHE_SPACE" not in instance_env(spec, None, base={"VLLM_CPU_KVCACHE_SPACE": "9"})


def test_layerwise_threshold_and_per_instance_args_reach_the_command_line():
    from vllm_disagg.launch.local import InstanceSpec

    spec = InstanceSpec("prefill", 0, 1, 2, "0", kv_extra={"layerwise_threshold_tokens": 0}, args=["--seed", "1"])
    cmd = serve_command(spec, "/m", "tcp", ["--dtype", "float32"], vllm_cmd=["vllm", "serve"])
    kv = json.loads(cmd[cmd.index("--additional-config") + 1])["disagg"]["kv"]
    assert kv["layerwise_threshold_tokens"] == 0
    assert cmd[-4:] == ["--dtype", "float32", "--seed", "1"]


def test_plugin_flags_passed_to_up_enable_the_plugin_on_every_instance():
    from vllm_disagg.launch.local import plan_instances, serve_command

    for spec in plan_instances(1, 1, 0):
        cmd = serve_command(spec, "/m", "tcp", ["--disagg-nano-batches", "2"], vllm_cmd=["vllm", "serve"])
        assert cmd[cmd.index("--plugin") + 1] == "disagg"
        assert cmd[-2:] == ["--disagg-nano-batches", "2"]
    plain = serve_command(plan_instances(1, 1, 0)[0], "/m", "tcp", ["--dtype", "float32"], vllm_cmd=["vllm", "serve"])
    assert "--plugin" not in plain
