# SPDX-License-Identifier: Apache-2.0
"""`vllm launch disagg-attn-server` is `vllm-disagg attn-server` under vLLM's launch registry (pinned, vLLM 0.32)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")


def _launch_parser():
    from vllm.entrypoints.cli.launch import LaunchSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_disagg.router as router

    router.register()
    parser = FlexibleArgumentParser(prog="vllm")
    LaunchSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def test_vllm_launch_lists_disagg_attn_server_once_and_maps_port_to_the_http_port():
    from vllm.entrypoints.cli.launch import LaunchSubcommandBase

    import vllm_disagg.router as router

    parser = _launch_parser()
    router.register()  # idempotent
    assert [c.name for c in LaunchSubcommandBase.__subclasses__()].count("disagg-attn-server") == 1
    args = parser.parse_args(["launch", "disagg-attn-server", "--transport", "tcp", "--port", "8301",
                              "--data-port", "9301", "--kv-cache-gib", "0.5", "--threads", "2"])
    from vllm_disagg.router.vllm_launch import DisaggAttnServerSubcommand

    assert args.launch_command is DisaggAttnServerSubcommand.cmd
    assert (args.port, args.data_port, args.transport, args.kv_cache_gib, args.threads) == (8301, 9301, "tcp", 0.5, 2)


def test_attn_server_cli_has_a_data_port_flag_defaulting_to_any_port():
    import argparse

    from vllm_disagg.attention.cli import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    assert p.parse_args([]).data_port == 0
    assert p.parse_args(["--data-port", "9400"]).data_port == 9400


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_launch_disagg_attn_server_serves_health_on_port_and_data_on_the_fixed_data_port(tmp_path):
    http_port, data_port = _free_port(), _free_port()
    ready = tmp_path / "ready.json"
    vllm = Path(sys.executable).with_name("vllm")
    env = {**os.environ, "VLLM_DISAGG_AUTH_TOKEN": "t0ken", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [str(vllm), "launch", "disagg-attn-server", "--transport", "tcp", "--host", "127.0.0.1",
           "--port", str(http_port), "--data-port", str(data_port), "--kv-cache-gib", "0.01",
           "--ready-file", str(ready), "--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no READY from vllm launch disagg-attn-server"
            time.sleep(0.2)
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10))
        assert health["status"] == "ok" and health["transport"] == "tcp"
        assert health["address"].rsplit(":", 1)[1] == str(data_port)
        assert json.loads(ready.read_text())["http"] == f"127.0.0.1:{http_port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
