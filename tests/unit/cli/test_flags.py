# SPDX-License-Identifier: Apache-2.0
import argparse

import pytest

from vllm_disagg.cli.flags import FLAGS, add_disagg_flags, flags_to_config, merge_flags_into_namespace
from vllm_disagg.config import DisaggConfigError


def parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--additional-config", type=lambda s: __import__("json").loads(s), default=None)
    add_disagg_flags(parser)
    return parser.parse_args(argv)


def test_without_the_plugin_flag_the_namespace_is_untouched():
    args = parse(["--additional-config", '{"other": 1}'])
    merge_flags_into_namespace(args)
    assert args.additional_config == {"other": 1}


def test_a_disagg_flag_without_the_plugin_is_an_error_naming_the_flag():
    with pytest.raises(DisaggConfigError, match="--disagg-nano-batches needs --plugin disagg"):
        flags_to_config(parse(["--disagg-nano-batches", "2"]))


def test_flags_fold_into_additional_config_and_keep_other_keys():
    args = parse(["--plugin", "disagg", "--additional-config", '{"other": 1, "disagg": {"peers": ["a:1"]}}',
                  "--disagg-peer", "b:2,c:3", "--disagg-auth-token", "s3cret"])
    merge_flags_into_namespace(args)
    assert args.additional_config["other"] == 1
    disagg = args.additional_config["disagg"]
    assert disagg["peers"] == ["b:2", "c:3"]
    assert disagg["auth_token"] == "s3cret"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--disagg-peer", "nohost"], "--disagg-peer"),
        (["--disagg-kv-port", "70000"], "--disagg-kv-port"),
        (["--disagg-kv-port", "x"], "--disagg-kv-port"),
        (["--disagg-push-timeout", "-1"], "--disagg-push-timeout"),
        (["--disagg-nano-batches", "0"], "--disagg-nano-batches"),
        (["--disagg-pipeline", "99"], "--disagg-pipeline"),
        (["--disagg-pipeline", "3"], "--disagg-pipeline"),  # the schedule exists, no runtime
        (["--disagg-attention-servers", "a:b"], "--disagg-attention-servers"),
    ],
)
def test_every_bad_value_gets_one_line_naming_its_flag(argv, flag):
    with pytest.raises(DisaggConfigError) as err:
        flags_to_config(parse(["--plugin", "disagg", *argv]))
    assert str(err.value).startswith(flag + ":")
    assert "\n" not in str(err.value)


def test_an_unknown_plugin_is_rejected():
    with pytest.raises(DisaggConfigError, match="unknown plugin 'nope'"):
        flags_to_config(parse(["--plugin", "nope"]))


def test_every_flag_maps_to_a_real_config_key():
    from vllm_disagg.config import DisaggConfig

    for flag in FLAGS:
        model = DisaggConfig
        *parents, leaf = flag.key.split(".")
        for part in parents:
            model = [a for a in model.model_fields[part].annotation.__args__ if a is not type(None)][0]
        assert leaf in model.model_fields, flag.flag


def test_a_vllm_serve_model_worker_gets_the_connector_that_restores_its_servers_kv_unless_one_is_given():
    from vllm.config import KVTransferConfig

    args = parse(["--plugin", "disagg", "--disagg-attention-servers", "127.0.0.1:8301"])
    args.kv_transfer_config = None
    merge_flags_into_namespace(args)
    kv = args.kv_transfer_config
    assert isinstance(kv, KVTransferConfig) and kv.kv_connector == "DisaggConnector"
    assert kv.kv_role == "kv_consumer" and kv.kv_load_failure_policy == "recompute"
    args = parse(["--plugin", "disagg", "--disagg-attention-servers", "127.0.0.1:8301"])
    args.kv_transfer_config = mine = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    merge_flags_into_namespace(args)
    assert args.kv_transfer_config is mine


def test_a_deprecated_flag_spelling_still_works_and_errors_name_it_as_typed():
    cfg = flags_to_config(parse(["--plugin", "disagg", "--disagg-nano-batches", "4"]))
    assert cfg.nanoflow.num_nano_batches == 4
    assert flags_to_config(parse(["--plugin", "disagg", "--disagg-num-nano-batches", "4"])) == cfg
    with pytest.raises(DisaggConfigError, match="--disagg-nano-batches: expected an integer"):
        flags_to_config(parse(["--plugin", "disagg", "--disagg-nano-batches", "x"]))
