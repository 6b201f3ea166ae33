# SPDX-License-Identifier: Apache-2.0
"""P3: the wiring applies on 0.32, is a no-op without "disagg", and is idempotent."""

import importlib

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_disagg import patch_hooks  # noqa: E402
from vllm_disagg.config import DisaggConfigError  # noqa: E402
from vllm_disagg.patches import engine_config_wiring  # noqa: E402


def test_the_patch_applies_and_is_idempotent_under_reload():
    assert engine_config_wiring.apply(patch_hooks())
    wrapped = EngineArgs.create_engine_config
    importlib.reload(engine_config_wiring)
    assert engine_config_wiring.apply(patch_hooks())
    assert EngineArgs.create_engine_config is wrapped
    assert EngineArgs._vllm_disagg_original_create_engine_config is not wrapped


def test_without_disagg_the_engine_args_are_untouched(tiny_model_dir):
    from vllm_disagg.wiring import wire_engine_args

    args = EngineArgs(model=tiny_model_dir, additional_config={"x": 1})
    assert wire_engine_args(args) is None
    assert args.worker_cls == "auto" and args.kv_transfer_config is None


def test_a_bad_disagg_config_fails_before_the_engine_starts(tiny_model_dir):
    engine_config_wiring.apply(patch_hooks())
    args = EngineArgs(model=tiny_model_dir, additional_config={"disagg": {"rol": "prefill"}})
    with pytest.raises(DisaggConfigError, match="rol"):
        args.create_engine_config()


def test_an_attention_role_is_pointed_at_the_attention_server(tiny_model_dir):
    engine_config_wiring.apply(patch_hooks())
    args = EngineArgs(model=tiny_model_dir, additional_config={"disagg": {"role": "attention"}})
    with pytest.raises(DisaggConfigError, match="vllm-disagg attn-server"):
        args.create_engine_config()


@pytest.mark.parametrize(
    "disagg, worker",
    [
        ({"nanoflow": {"nano_batches": 2}}, "vllm_disagg.nanoflow.worker.NanoFlowCPUWorker"),
        ({"remote_attention": {"servers": ["127.0.0.1:7000"]}}, "vllm_disagg.attention.worker.DisaggAttentionWorker"),
        ({"nanoflow": {"nano_batches": 2}, "remote_attention": {"servers": ["127.0.0.1:7000"]}},
         "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"),
    ],
)
def test_the_disagg_config_selects_the_worker_class(tiny_model_dir, disagg, worker):
    from vllm_disagg.wiring import wire_engine_args

    args = EngineArgs(model=tiny_model_dir, additional_config={"disagg": disagg})
    wire_engine_args(args)
    assert args.worker_cls == worker
    # a model worker keeps one KV cache group (windows in full: attention/worker.py), any partition
    assert args.disable_hybrid_kv_cache_manager is ("remote_attention" in disagg or None)


def test_a_prefill_role_gets_the_producer_connector_and_keeps_explicit_choices(tiny_model_dir):
    from vllm.config import KVTransferConfig

    from vllm_disagg.wiring import wire_engine_args

    args = EngineArgs(model=tiny_model_dir, additional_config={"disagg": {"role": "prefill"}})
    wire_engine_args(args)
    kv = args.kv_transfer_config
    assert (kv.kv_connector, kv.kv_connector_module_path, kv.kv_role) == (
        "DisaggConnector", "vllm_disagg.kv.connector", "kv_producer")
    mine = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_consumer")
    explicit = EngineArgs(model=tiny_model_dir, worker_cls="my.Worker", kv_transfer_config=mine,
                          additional_config={"disagg": {"role": "decode", "nanoflow": {"nano_batches": 2}}})
    wire_engine_args(explicit)
    assert explicit.worker_cls == "my.Worker" and explicit.kv_transfer_config is mine
