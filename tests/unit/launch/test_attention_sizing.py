# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --attention K` sizes its servers from the model: the README's shape needs no flags."""

from __future__ import annotations

import json

import pytest

from vllm_disagg.cli.main import build_parser
from vllm_disagg.launch.attention_sizing import GIB, ModelKV, SizingError, model_kv, size_attention
from vllm_disagg.launch.cli import plan_from_args

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "hidden_size": 576, "max_position_embeddings": 8192, "dtype": "bfloat16"}


@pytest.fixture
def smollm2_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    return str(tmp_path)


def _args(*argv: str):
    return build_parser().parse_args(["up", *argv])


def test_model_kv_reads_the_model_and_the_vllm_flags(smollm2_dir):
    kv = model_kv(smollm2_dir, [])
    assert (kv.num_layers, kv.num_kv_heads, kv.head_size, kv.max_model_len, kv.dtype_bytes, kv.block_size) == (
        30, 3, 64, 8192, 2, 128)
    kv = model_kv(smollm2_dir, ["--dtype", "float32", "--max-model-len=2k", "--block-size", "32"])
    assert (kv.max_model_len, kv.dtype_bytes, kv.block_size) == (2000, 4, 32)
    # SmolLM2 at its default 8192 in float32: 64 blocks x 30 layers x 3 heads x 128 x 2 x 64 x 4 bytes
    assert kv.bytes_for(8192, 3) == 64 * 30 * 3 * 128 * 2 * 64 * 4 == int(0.3515625 * GIB)


def test_the_readme_shape_without_flags_resolves_request_wise_and_fits(smollm2_dir):
    specs = plan_from_args(_args("--decode", "1", "--attention", "2", "--model", "smollm2-135m"), smollm2_dir)
    servers, worker = specs[:2], specs[2]
    assert [s.role for s in specs] == ["attention", "attention", "mixed"]
    remote_attention = worker.disagg_extra["remote_attention"]
    assert remote_attention["partition"] == "request"  # 2 servers do not divide 3 KV heads
    sizes = {float(s.args[s.args.index("--kv-cache-gib") + 1]) for s in servers}
    assert len(sizes) == 1 and sizes.pop() >= model_kv(smollm2_dir, []).bytes_for(8192, 3) / GIB


def test_three_servers_go_head_wise_and_hold_a_third_of_the_heads_each(smollm2_dir):
    kv = model_kv(smollm2_dir, ["--dtype", "float32"])
    sizing = size_attention(kv, 3, "auto", None, 1.0, available=64 * GIB)
    assert sizing.partition == "head"
    assert sizing.needed_gib == pytest.approx(kv.bytes_for(8192, 1) / GIB)
    assert sizing.kv_cache_gib >= sizing.needed_gib


def test_a_too_small_explicit_size_fails_in_one_line_naming_both_flags(smollm2_dir):
    args = _args("--decode", "1", "--attention", "2", "--attention-kv-cache-gib", "0.25", "--dtype", "float32")
    with pytest.raises(SizingError) as err:
        plan_from_args(args, smollm2_dir)
    msg = str(err.value)
    assert "--attention-kv-cache-gib" in msg and "--max-model-len" in msg and "\n" not in msg
    assert "at most 5760 fits" in msg  # 45 whole 128-token blocks of 5.625 MiB in 0.25 GiB


def test_too_little_free_memory_fails_in_one_line_naming_both_flags():
    kv = ModelKV(num_layers=30, num_kv_heads=3, head_size=64, max_model_len=8192, dtype_bytes=4)
    with pytest.raises(SizingError) as err:
        size_attention(kv, 2, "request", None, 1.0, available=int(0.5 * GIB))
    msg = str(err.value)
    assert "--attention-kv-cache-gib" in msg and "--max-model-len" in msg and "\n" not in msg


def test_an_explicit_head_partition_that_cannot_split_the_heads_says_what_to_use(smollm2_dir):
    with pytest.raises(SizingError, match="--attention-partition request"):
        plan_from_args(_args("--attention", "2", "--attention-partition", "head"), smollm2_dir)


def test_a_family_with_its_own_config_names_is_read_through_transformers_attribute_map(tmp_path):
    # BLOOM names its heads and layers n_head and n_layer (up --attention crashed on KeyError before)
    bloom = {"model_type": "bloom", "n_layer": 2, "n_head": 4, "hidden_size": 256, "dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(bloom))
    kv = model_kv(str(tmp_path), ["--max-model-len", "2048"])
    assert (kv.num_layers, kv.num_kv_heads, kv.head_size, kv.max_model_len, kv.dtype_bytes) == (2, 4, 64, 2048, 4)


def test_a_config_without_heads_or_layers_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "made_up", "hidden_size": 64}))
    with pytest.raises(SizingError, match="has no num_attention_heads, num_hidden_layers"):
        model_kv(str(tmp_path), [])
