# SPDX-License-Identifier: Apache-2.0
"""The Ray launcher's parts that need no Ray cluster: specs, the real server command lines, placement
bundles, the instance body running a real attention server, and the reaper killing an orphaned group.
(The whole path on a real two-node Ray cluster: tests/integration/test_ray.py.)"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict

import pytest

from vllm_disagg.launch.ray import (
    ActorSpec,
    InstanceServer,
    RayCluster,
    add_ray_args,
    build_parser,
    plan_actor_specs,
    server_command,
)


def up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_up_flags_and_ray_flags_parse_together_and_unknown_args_go_to_vllm():
    args = up_args("--backend", "ray", "--address", "ray://head:10001", "--prefill", "2", "--decode", "1",
                   "--attention", "2", "--dtype", "float32")
    assert (args.backend, args.address, args.prefill, args.decode, args.attention) == (
        "ray", "ray://head:10001", 2, 1, 2)
    assert args.vllm_args == ["--dtype", "float32"]


def test_specs_start_attention_first_and_share_one_token(monkeypatch):
    monkeypatch.delenv("VLLM_DISAGG_AUTH_TOKEN", raising=False)
    specs = plan_actor_specs(up_args("--prefill", "2", "--decode", "1", "--attention", "2"), "/m")
    assert [s.name for s in specs] == ["vllm-disagg:attention0", "vllm-disagg:attention1", "vllm-disagg:prefill0",
                                       "vllm-disagg:prefill1", "vllm-disagg:decode0"]
    assert [s.http_port for s in specs[:2]] == [8300, 8301] and specs[2].http_port == 0
    assert len({s.env["VLLM_DISAGG_AUTH_TOKEN"] for s in specs}) == 1
    # the prefill actors allocate as the model worker they push into: one KV cache group
    assert ["--disable-hybrid-kv-cache-manager" in s.vllm_args for s in specs] == [False, False, True, True, False]
    assert plan_actor_specs(up_args("--prefill", "0", "--decode", "0"), "/m")[0].role == "mixed"
    with pytest.raises(ValueError, match="--decode"):
        plan_actor_specs(up_args("--prefill", "1", "--decode", "0"), "/m")


def test_attention_workers_serve_exactly_one_model_worker():
    with pytest.raises(ValueError, match="exactly one model worker"):
        plan_actor_specs(up_args("--prefill", "1", "--decode", "2", "--attention", "2"), "/m")
    specs = plan_actor_specs(up_args("--prefill", "0", "--decode", "0", "--attention", "2"), "/m")
    assert [s.role for s in specs] == ["attention", "attention", "mixed"]
    assert specs[0].kv_transport is None  # no prefill instance: nothing pushes into the servers


def _parse_vllm_serve(cmd: list[str]) -> dict:
    """additional_config["disagg"] as `vllm serve` with the plugin would see it."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_disagg
    from vllm_disagg.cli.flags import merge_flags_into_namespace, worker_cls_for
    from vllm_disagg.config import parse_disagg_config

    vllm_disagg.register()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *cmd[cmd.index("serve") + 1:]])
    merge_flags_into_namespace(args)
    disagg = args.additional_config["disagg"]
    return {**disagg, "worker_cls": worker_cls_for(parse_disagg_config(disagg))}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_pushes_into_the_attention_workers_as_on_the_local_backend(monkeypatch, transport):
    """Same wiring as `launch.local.attach_attention`: the servers accept the prefill instances'
    kv.transport (`--kv-transport`), the one decode model worker gets partition/pipeline, one token."""
    from vllm_disagg.attention.cli import add_server_args
    from vllm_disagg.launch.local import AttentionPlan, attach_attention, plan_instances

    monkeypatch.setenv("VLLM_DISAGG_AUTH_TOKEN", "shared-secret")
    argv = ("--prefill", "1", "--decode", "1", "--attention", "2", "--transport", transport,
            "--attention-partition", "request", "--pipeline", "2", "--attention-kv-cache-gib", "3")
    specs = {s.name.split(":")[1]: s for s in plan_actor_specs(up_args(*argv), "/m")}
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    for i in range(2):  # the real attn-server parser accepts the command line
        cmd = server_command(specs[f"attention{i}"], "10.0.0.9", 8300 + i, None)
        srv = parser.parse_args(cmd[cmd.index("attn-server") + 1:])
        assert (srv.kv_transport, srv.transport, srv.kv_cache_gib, srv.http_port) == (transport, "tcp", 3.0, 8300 + i)
    assert {s.env["VLLM_DISAGG_AUTH_TOKEN"] for s in specs.values()} == {"shared-secret"}
    decode = specs["decode0"]
    decode.attention_servers = ["10.0.0.9:8300", "10.0.0.9:8301"]
    disagg = _parse_vllm_serve(server_command(decode, "10.0.0.8", 8200, 9200))
    ra = disagg["remote_attention"]
    assert (disagg["role"], disagg["kv"]["transport"], disagg["kv"]["kv_port"]) == ("decode", transport, 9200)
    assert (ra["servers"], ra["partition"], ra["pipeline"], ra["transport"]) == (
        decode.attention_servers, "request", 2, "tcp")
    assert disagg["nanoflow"]["num_nano_batches"] == 2
    assert "replacement_wait_s" not in decode.remote_attention  # request-wise: the survivors go on at once
    head = plan_actor_specs(up_args("--prefill", "1", "--decode", "1", "--attention", "2"), "/m")[-1]
    assert head.remote_attention["replacement_wait_s"] >= 120  # head-wise: wait for Ray's restart
    assert disagg["worker_cls"] == "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"
    # the local backend wires the same: --kv-transport = the P/D transport, same remote_attention
    local = plan_instances(1, 1, 0, 1, num_attention=2)
    user = attach_attention(local, AttentionPlan(2, "request", 2, "tcp", 3.0, None, transport))
    att = [s for s in local if s.role == "attention"][0]
    assert att.args[att.args.index("--kv-transport") + 1] == transport
    # a fixed KV port over tcp: a restarted server must keep the address the model worker advertised
    # to P (an ephemeral one made every push to it fail until the decode instance restarted)
    assert ("--kv-port" in att.args) == (transport == "tcp")
    keys = ("partition", "pipeline", "transport")
    assert [user.disagg_extra["remote_attention"][k] for k in keys] == [ra[k] for k in keys]
    assert user.disagg_extra["nanoflow"] == disagg["nanoflow"]


def test_instances_run_the_plugins_real_commands():
    p = ActorSpec("prefill", 0, "/m", served_name="tiny", vllm_args=["--dtype", "float32"])
    cmd = server_command(p, "10.0.0.7", 8100, 9100)
    assert cmd[1:3] == ["serve", "/m"] and cmd[0].endswith("/vllm")
    joined = " ".join(cmd)
    assert "--host 10.0.0.7 --port 8100 --middleware vllm_disagg.liveness.LiveMiddleware --served-model-name tiny" in joined
    assert "--plugin disagg --disagg-role prefill --disagg-kv-port 9100 --disagg-transport tcp" in joined
    # /live and the body cap, as on the local backend: without them the routers' adaptive hang detection
    # never engaged on Ray (the Ray chaos soak: no suspect mark, requests waited out the fixed 10 s)
    for role in ("prefill", "decode", "mixed"):
        rcmd = server_command(ActorSpec(role, 0, "/m"), "h", 1, 2)
        assert rcmd[rcmd.index("--middleware") + 1] == "vllm_disagg.liveness.LiveMiddleware"
    assert cmd[-2:] == ["--dtype", "float32"]
    d = ActorSpec("decode", 0, "/m", attention_servers=["10.0.0.9:8300"])
    dcmd = server_command(d, "10.0.0.8", 8200, 9200)
    assert dcmd[dcmd.index("--disagg-attention-servers") + 1] == "10.0.0.9:8300"
    assert json.loads(dcmd[dcmd.index("--additional-config") + 1])["disagg"]["remote_attention"]["transport"] == "tcp"
    a = server_command(ActorSpec("attention", 1, "/m", kv_cache_gib=0.5), "10.0.0.9", 8301, None)
    assert a[0].endswith("/vllm-disagg") and a[1:] == ["attn-server", "--transport", "tcp", "--host", "10.0.0.9",
                                                        "--http-port", "8301", "--kv-cache-gib", "0.5"]
    assert "--plugin" not in server_command(ActorSpec("mixed", 0, "/m"), "h", 1, None)
    # the one model worker without P/D gets the connector (consumer) as on the local backend
    m = server_command(ActorSpec("mixed", 0, "/m", attention_servers=["10.0.0.9:8300"]), "h", 1, None)
    kv = json.loads(m[m.index("--kv-transfer-config") + 1])
    assert (kv["kv_connector"], kv["kv_role"], kv["kv_load_failure_policy"]) == ("DisaggConnector", "kv_consumer",
                                                                                "recompute")


def test_bundles_ask_for_the_pools_custom_resource_and_optional_gpus():
    parser = argparse.ArgumentParser()
    add_ray_args(parser)
    args = parser.parse_args(["--gpus-per-instance", "1", "--accelerator-type", "H100", "--cpus-per-instance", "4"])
    cluster = RayCluster([], args)
    assert cluster.bundle("prefill") == {"CPU": 4.0, "prefill": 1, "GPU": 1.0, "accelerator_type:H100": 0.001}
    assert cluster.bundle("attention") == {"CPU": 4.0, "attention": 1}
    assert cluster.bundle("mixed") == {"CPU": 4.0, "GPU": 1.0, "accelerator_type:H100": 0.001}


@pytest.mark.slow
def test_the_instance_body_serves_a_real_attention_server_and_reports_its_endpoint(tmp_path):
    spec = ActorSpec("attention", 0, "/unused", kv_cache_gib=0.125, http_port=0, kv_transport="tcp",
                     env={"VLLM_DISAGG_AUTH_TOKEN": uuid.uuid4().hex}, log_dir=str(tmp_path / "logs"))
    inst = InstanceServer(asdict(spec), host="127.0.0.1", exit_with_server=False)
    assert inst.log_path.parent.parent == tmp_path / "logs"
    try:
        deadline = time.monotonic() + 120
        while not inst.endpoint()["up"]:
            assert inst.proc.poll() is None, inst.log_tail()
            assert time.monotonic() < deadline, inst.log_tail()
            time.sleep(0.5)
        ep = inst.endpoint()
        assert ep["role"] == "attention" and ep["kv"] is None and ep["starts"] == 1
        with urllib.request.urlopen(f"{ep['url']}/health", timeout=5) as resp:
            health = json.loads(resp.read())
        assert health["transport"] == "tcp" and health["kv_transport"] == "tcp"  # accepts prefill pushes
    finally:
        assert inst.stop() is not None
    assert inst.endpoint()["up"] is False
    assert not inst.log_dir.exists()  # a clean stop removes the log; a crash keeps it


def test_the_reaper_kills_the_server_group_when_its_owner_dies():
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    read_fd, write_fd = os.pipe()
    reaper = subprocess.Popen([sys.executable, "-m", "vllm_disagg.launch.reaper", str(read_fd), str(server.pid)],
                              pass_fds=(read_fd,), start_new_session=True)
    os.close(read_fd)
    try:
        time.sleep(0.5)
        assert server.poll() is None  # owner alive: nothing happens
        os.close(write_fd)  # what the kernel does when the owner dies
        assert server.wait(timeout=20) == -signal.SIGTERM
        assert reaper.wait(timeout=20) == 0
    finally:
        for p in (server, reaper):
            if p.poll() is None:
                p.kill()


def test_attention_workers_are_sized_from_the_model_as_on_the_local_backend(tmp_path):
    """SmolLM2's shape (3 KV heads, 8192 tokens, bf16) on 2 workers: request-wise, each holding one
    request of the max length (0.176 GiB) at least; a path with no config.json here keeps the flags."""
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "hidden_size": 576, "max_position_embeddings": 8192, "dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = up_args("--prefill", "0", "--decode", "0", "--attention", "2")
    specs = plan_actor_specs(args, str(tmp_path))
    assert args.attention_partition == "request"
    assert specs[2].remote_attention["partition"] == "request"
    assert all(s.kv_cache_gib >= 0.176 for s in specs[:2])
    with pytest.raises(ValueError, match="--attention-kv-cache-gib"):
        plan_actor_specs(up_args("--decode", "1", "--attention", "2", "--attention-kv-cache-gib", "0.1"),
                         str(tmp_path))
    fixed = plan_actor_specs(up_args("--decode", "1", "--attention", "2", "--attention-kv-cache-gib", "0.5"), "/m")
    assert fixed[0].kv_cache_gib == 0.5


def test_each_attention_server_advertises_its_own_kv_address_on_the_local_backend_only():
    """`up --attention-kv-advertise A,B`: server i's `attn-server --kv-advertise` is the i-th address (the
    real parser accepts it); a wrong count, shm pushes or no prefill instance are refused with one line,
    and so is the Ray backend, which places the servers itself."""
    from vllm_disagg.attention.cli import add_server_args
    from vllm_disagg.launch.local import AttentionPlan, attach_attention, plan_instances

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    local = plan_instances(1, 1, 0, 1, num_attention=2)
    attach_attention(local, AttentionPlan(2, "request", 1, "tcp", None, None, "tcp", ["127.0.0.1:7001", "127.0.0.1:7002"]))
    servers = [s for s in local if s.role == "attention"]
    assert [parser.parse_args(s.args).kv_advertise for s in servers] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    bad = [(1, 1, "tcp", ["127.0.0.1:7001"], "names 1 addresses for 2"),
           (1, 1, "shm", ["127.0.0.1:7001", "127.0.0.1:7002"], "--transport tcp"),
           (0, 1, "tcp", ["127.0.0.1:7001", "127.0.0.1:7002"], "--transport tcp"),
           (1, 1, "tcp", ["127.0.0.1:7001", "nowhere"], "expected HOST:PORT")]
    for num_prefill, num_decode, kv_transport, addresses, message in bad:
        specs = plan_instances(num_prefill, 0 if not num_prefill else num_decode, 0 if num_prefill else 1, 1,
                               num_attention=2)
        with pytest.raises(ValueError, match=message):
            attach_attention(specs, AttentionPlan(2, "request", 1, "tcp", None, None, kv_transport, addresses))
    with pytest.raises(ValueError, match="--backend local only"):
        plan_actor_specs(up_args("--prefill", "1", "--decode", "1", "--attention", "2",
                                 "--attention-kv-advertise", "127.0.0.1:7001,127.0.0.1:7002"), "/m")
