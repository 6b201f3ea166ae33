# SPDX-License-Identifier: Apache-2.0
import pytest

from vllm_disagg.config import DisaggConfig, DisaggConfigError, parse_disagg_config


def test_an_empty_config_is_valid_and_not_enabled():
    cfg = parse_disagg_config({})
    assert cfg == DisaggConfig()
    assert not cfg.enabled


def test_sections_enable_the_plugin():
    assert parse_disagg_config({"role": "prefill"}).enabled
    assert parse_disagg_config({"nanoflow": {"nano_batches": 4}}).enabled
    assert parse_disagg_config({"remote_attention": {"servers": ["127.0.0.1:7000"]}}).enabled


def test_an_unknown_key_is_named_with_the_known_keys():
    with pytest.raises(DisaggConfigError) as err:
        parse_disagg_config({"kv": {"layerwise_treshold_tokens": 5}})
    msg = str(err.value)
    assert "kv.layerwise_treshold_tokens" in msg
    assert "layerwise_threshold_tokens" in msg  # the fix is in the message


def test_a_bad_value_names_its_key_and_value():
    with pytest.raises(DisaggConfigError) as err:
        parse_disagg_config({"remote_attention": {"servers": ["localhost"]}})
    assert 'additional_config["disagg"].remote_attention.servers' in str(err.value)
    assert "'localhost'" in str(err.value)


def test_nano_batches_accepts_auto_or_a_small_positive_integer():
    assert parse_disagg_config({"nanoflow": {"nano_batches": "auto"}}).nanoflow.nano_batches == "auto"
    for bad in (0, 65, "many"):
        with pytest.raises(DisaggConfigError):
            parse_disagg_config({"nanoflow": {"nano_batches": bad}})


def test_a_non_dict_config_is_rejected_clearly():
    with pytest.raises(DisaggConfigError, match="must be a JSON object"):
        parse_disagg_config(["prefill"])


def test_a_renamed_key_still_works_under_its_old_name_and_errors_name_it_as_written(caplog):
    from vllm_disagg.config import DisaggConfigError, parse_disagg_config

    old = parse_disagg_config({"nanoflow": {"nano_batches": 4}})
    assert old == parse_disagg_config({"nanoflow": {"num_nano_batches": 4}})
    assert old.nanoflow.nano_batches == 4  # the deprecated attribute name reads the new field
    with pytest.raises(DisaggConfigError, match=r"nanoflow\.nano_batches"):
        parse_disagg_config({"nanoflow": {"nano_batches": 0}})
    with pytest.raises(DisaggConfigError, match="deprecated name"):
        parse_disagg_config({"nanoflow": {"nano_batches": 2, "num_nano_batches": 2}})


def test_send_q_early_auto_is_resolved_at_parse_time_to_what_the_kernel_returns():
    from vllm_disagg.config import kernel_returns_lse

    remote_attention = parse_disagg_config({"remote_attention": {"servers": ["127.0.0.1:7000"]}}).remote_attention
    assert remote_attention.send_q_early is kernel_returns_lse() is False  # vLLM's CPU kernel returns no LSE
    auto = parse_disagg_config({"remote_attention": {"send_q_early": "auto"}}).remote_attention
    assert auto.send_q_early is False
    assert parse_disagg_config({"remote_attention": {"send_q_early": True}}).remote_attention.send_q_early is True


def test_pipeline_depth_is_checked_at_parse_time_in_one_line():
    for depth in (1, 2):
        assert parse_disagg_config({"remote_attention": {"pipeline": depth}}).remote_attention.pipeline == depth
    for depth in (0, 3, 8):
        with pytest.raises(DisaggConfigError) as err:
            parse_disagg_config({"remote_attention": {"pipeline": depth}})
        msg = str(err.value)
        assert msg.startswith('additional_config["disagg"].remote_attention.pipeline:')
        assert f"{depth} has no runtime" in msg and "\n" not in msg


def test_partition_defaults_to_auto_head_wise_only_when_the_servers_divide_the_kv_heads():
    from vllm_disagg.config import resolve_partition

    assert parse_disagg_config({"remote_attention": {}}).remote_attention.partition == "auto"
    assert resolve_partition("auto", 2, 4) == "head"
    assert resolve_partition("auto", 3, 3) == "head"
    assert resolve_partition("auto", 2, 3) == "request"  # SmolLM2's 3 KV heads on 2 servers
    assert resolve_partition("head", 2, 3) == "head"  # explicit: left to fail with its own message


def test_the_advertised_kv_address_must_be_host_port():
    assert parse_disagg_config({"kv": {"advertise_address": "kv.example:7000"}}).kv.advertise_address == "kv.example:7000"
    with pytest.raises(DisaggConfigError, match="advertise_address"):
        parse_disagg_config({"kv": {"advertise_address": "no-port"}})
