# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --attention K`: attention servers planned first, the model worker pointed at them."""

from __future__ import annotations

import json

import pytest

from vllm_disagg.cli.main import build_parser
from vllm_disagg.config import parse_disagg_config
from vllm_disagg.launch.cli import plan_from_args
from vllm_disagg.launch.local import serve_command


def _plan(*argv: str):
    return plan_from_args(build_parser().parse_args(["up", *argv]))


def _disagg(cmd: list[str]) -> dict:
    return json.loads(cmd[cmd.index("--additional-config") + 1])["disagg"]


def test_attention_without_prefill_makes_one_mixed_model_worker_on_all_servers():
    specs = _plan("--prefill", "0", "--attention", "2", "--attention-partition", "request", "--dtype", "float32")
    assert [s.name for s in specs] == ["attention0", "attention1", "mixed0"]
    assert len({s.http_port for s in specs}) == 3 and all(s.kv_port is None for s in specs)
    cmd = serve_command(specs[2], "/m", "tcp", ["--dtype", "float32"], vllm_cmd=["vllm", "serve"])
    disagg = _disagg(cmd)
    assert disagg == {"remote_attention": {"servers": [f"127.0.0.1:{s.http_port}" for s in specs[:2]],
                                           "partition": "request", "pipeline": 1, "transport": "shm"}}
    cfg = parse_disagg_config(disagg)  # the engine parses exactly this
    from vllm_disagg.cli.flags import REMOTE_ATTN_WORKER, worker_cls_for

    assert worker_cls_for(cfg) == REMOTE_ATTN_WORKER
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])  # restores retained KV after a restart
    assert kv["kv_role"] == "kv_consumer" and kv["kv_load_failure_policy"] == "recompute"
    from vllm_disagg.cli.flags import reuse_connector_config

    assert reuse_connector_config() == kv  # what `vllm serve --plugin disagg` adds by itself


def test_attention_servers_run_attn_server_with_shared_settings_and_exit_with_the_launcher():
    specs = _plan("--prefill", "0", "--attention", "2", "--attention-transport", "tcp",
                  "--attention-kv-cache-gib", "0.5")
    cmd = serve_command(specs[0], "/m", "tcp", ["--dtype", "float32"])
    assert cmd[1:3] == ["-m", "vllm_disagg.attention.cli"] and "--dtype" not in cmd
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--http-port"] == str(specs[0].http_port) and flags["--transport"] == "tcp"
    assert flags["--kv-cache-gib"] == "0.5" and "--parent-pid" in flags
    assert _disagg(serve_command(specs[2], "/m", "tcp", []))["remote_attention"]["transport"] == "tcp"


def test_pipeline_two_adds_the_nano_batch_executor_and_send_q_early_can_be_turned_off():
    specs = _plan("--prefill", "0", "--attention", "1", "--pipeline", "2", "--no-send-q-early")
    disagg = _disagg(serve_command(specs[-1], "/m", "tcp", []))
    assert disagg["nanoflow"] == {"num_nano_batches": 2}
    assert disagg["remote_attention"]["pipeline"] == 2 and disagg["remote_attention"]["send_q_early"] is False
    from vllm_disagg.cli.flags import NANOFLOW_REMOTE_ATTN_WORKER, worker_cls_for

    assert worker_cls_for(parse_disagg_config(disagg)) == NANOFLOW_REMOTE_ATTN_WORKER


def test_attention_with_prefill_points_the_decode_instance_at_the_servers_and_keeps_its_connector():
    specs = _plan("--prefill", "1", "--decode", "1", "--attention", "2")
    assert [s.name for s in specs] == ["attention0", "attention1", "prefill0", "decode0"]
    d = serve_command(specs[3], "/m", "tcp", [], vllm_cmd=["vllm", "serve"])
    disagg = _disagg(d)
    assert disagg["role"] == "decode" and disagg["kv"]["kv_port"] == specs[3].kv_port
    assert len(disagg["remote_attention"]["servers"]) == 2
    p = serve_command(specs[2], "/m", "tcp", [], vllm_cmd=["vllm", "serve"])
    assert "remote_attention" not in _disagg(p)
    # P allocates as the model worker it pushes into: one KV cache group (handshake kv_groups)
    assert "--disable-hybrid-kv-cache-manager" in p and "--disable-hybrid-kv-cache-manager" not in d
    plain = _plan("--prefill", "1", "--decode", "1")
    assert "--disable-hybrid-kv-cache-manager" not in serve_command(plain[0], "/m", "tcp", [], vllm_cmd=["vllm", "serve"])


def test_each_attention_servers_kv_port_is_distinct_from_every_other_planned_port():
    """Drawn apart from the instances' ports: a draw of its own once handed attention1 attention0's
    HTTP port, and the server failed to bind it at its first INIT."""
    for _ in range(20):
        specs = _plan("--prefill", "1", "--decode", "1", "--attention", "2")
        kv_ports = [int(s.args[s.args.index("--kv-port") + 1]) for s in specs if s.role == "attention"]
        others = {s.http_port for s in specs} | {s.kv_port for s in specs if s.kv_port is not None}
        assert len(set(kv_ports)) == 2 and others.isdisjoint(kv_ports)


def test_the_router_port_is_never_handed_to_an_instance():
    """`up --port X` binds X only once the instances are up, so the plan's draws must skip it (the chaos
    harness draws X itself, from the same ephemeral range)."""
    from vllm_disagg.launch.instances import free_ports

    for _ in range(20):
        router_port = free_ports(1)[0]  # a port the next draw could well return
        specs = _plan("--prefill", "1", "--decode", "1", "--attention", "2", "--port", str(router_port))
        planned = {s.http_port for s in specs} | {s.kv_port for s in specs if s.kv_port is not None}
        planned |= {int(s.args[s.args.index("--kv-port") + 1]) for s in specs if "--kv-port" in s.args}
        assert router_port not in planned


def test_attention_servers_serve_exactly_one_model_worker():
    with pytest.raises(ValueError, match="exactly one model worker"):
        _plan("--prefill", "1", "--decode", "2", "--attention", "2")
    with pytest.raises(ValueError, match="exactly one model worker"):
        _plan("--prefill", "0", "--decode", "1", "--mixed", "1", "--attention", "2")


def test_no_attention_flag_leaves_the_plain_pd_plan_unchanged():
    specs = _plan("--prefill", "1", "--decode", "1")
    assert [s.name for s in specs] == ["prefill0", "decode0"]
    assert all("remote_attention" not in s.disagg_extra for s in specs)


def test_leaving_out_prefill_means_one_p_instance_but_none_with_attention_servers():
    assert [s.role for s in _plan()] == ["prefill", "decode"]
    assert [s.role for s in _plan("--attention", "2")] == ["attention", "attention", "mixed"]
