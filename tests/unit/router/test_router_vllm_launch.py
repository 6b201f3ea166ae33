# SPDX-License-Identifier: Apache-2.0
"""`vllm launch disagg-proxy`: discovered through LaunchSubcommandBase subclasses (pinned, vLLM 0.32)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm")


def test_register_is_inert_outside_the_vllm_cli_process(monkeypatch):
    import vllm_disagg.router as router

    monkeypatch.delitem(sys.modules, "vllm.entrypoints.cli.launch", raising=False)
    monkeypatch.delitem(sys.modules, "vllm_disagg.router.vllm_launch", raising=False)
    router.register()
    assert "vllm_disagg.router.vllm_launch" not in sys.modules


def test_vllm_launch_lists_disagg_proxy_and_parses_pool_flags_after_register():
    from vllm.entrypoints.cli.launch import LaunchSubcommand, LaunchSubcommandBase
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_disagg.router as router

    router.register()
    router.register()  # idempotent
    names = [c.name for c in LaunchSubcommandBase.__subclasses__()]
    assert names.count("disagg-proxy") == 1
    parser = FlexibleArgumentParser(prog="vllm")
    LaunchSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["launch", "disagg-proxy", "--prefill", "http://127.0.0.1:8100",
                              "--prefill-kv", "127.0.0.1:9100", "--decode", "http://127.0.0.1:8200",
                              "--port", "8123"])
    from vllm_disagg.router.cli import config_from_args
    from vllm_disagg.router.vllm_launch import DisaggProxySubcommand

    assert args.launch_command is DisaggProxySubcommand.cmd
    assert args.port == 8123
    assert config_from_args(args).prefill_kv == ["127.0.0.1:9100"]
