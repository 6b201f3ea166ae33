# SPDX-License-Identifier: Apache-2.0
"""P2: the patch applies on 0.32, is a no-op without --plugin, and is idempotent."""

import importlib

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

import vllm_disagg  # noqa: E402
from vllm_disagg.patches import cli_plugin_flag  # noqa: E402


def make_parser():
    vllm_disagg.register()
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def test_the_patch_applies_on_vllm_0_32():
    assert cli_plugin_flag.apply(vllm_disagg.patch_hooks())
    assert hasattr(EngineArgs, "_vllm_disagg_original_add_cli_args")
    assert "--plugin" in make_parser().format_help()


def test_without_the_plugin_flag_engine_args_equal_upstream(tiny_model_dir):
    argv = ["--model", tiny_model_dir, "--additional-config", '{"x": 1}', "--max-model-len", "64"]
    patched = AsyncEngineArgs.from_cli_args(make_parser().parse_args(argv))
    upstream_parser = EngineArgs._vllm_disagg_original_add_cli_args(FlexibleArgumentParser())
    upstream = EngineArgs._vllm_disagg_original_from_cli_args(EngineArgs, upstream_parser.parse_args(argv))
    assert patched.additional_config == upstream.additional_config == {"x": 1}
    assert patched.worker_cls == upstream.worker_cls
    assert patched.kv_transfer_config == upstream.kv_transfer_config is None


def test_plugin_flags_land_in_additional_config(tiny_model_dir):
    args = make_parser().parse_args(["--model", tiny_model_dir, "--plugin", "disagg", "--disagg-peer", "127.0.0.1:9"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config["disagg"]["peers"] == ["127.0.0.1:9"]


def test_a_bad_flag_exits_with_one_line(capsys):
    args = make_parser().parse_args(["--model", "m", "--plugin", "disagg", "--disagg-peer", "x"])
    with pytest.raises(SystemExit) as exc:
        AsyncEngineArgs.from_cli_args(args)
    assert str(exc.value) == "error: --disagg-peer: expected HOST:PORT, got 'x'"


def test_the_patch_is_idempotent_under_reload():
    before = EngineArgs.add_cli_args
    importlib.reload(cli_plugin_flag)
    assert cli_plugin_flag.apply(vllm_disagg.patch_hooks())
    assert EngineArgs.add_cli_args is before
    assert make_parser().format_help().count("--plugin NAME") == 1
