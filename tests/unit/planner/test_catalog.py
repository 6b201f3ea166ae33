# SPDX-License-Identifier: Apache-2.0
"""Catalog contents, user extension and HF config loading."""

import json

import pytest

from vllm_disagg.planner import catalog
from vllm_disagg.planner.catalog import ModelSpec, get_hardware, get_model

ISSUE_HARDWARE = ["a100-40g", "a100-80g", "h100", "h200", "h20", "b100", "b200", "mi250",
                  "mi300", "tpu-v6e", "dgx-a100", "dgx-h100"]
ISSUE_MODELS = ["llama-2-7b", "llama-2-70b", "llama-3-8b", "llama3-70b", "llama-33b",
                "llama-65b", "qwen2-72b", "deepseek-67b", "mixtral-8x7b"]


@pytest.mark.parametrize("name", ISSUE_HARDWARE)
def test_every_hardware_the_issue_lists_is_in_the_catalog(name):
    hw = get_hardware(name)
    assert hw.fp16_tflops > 0 and hw.mem_bw_gbs > 0 and hw.mem_gb > 0


@pytest.mark.parametrize("name", ISSUE_MODELS)
def test_every_model_the_issue_lists_is_in_the_catalog(name):
    m = get_model(name)
    assert m.num_params > 1e9 and m.kv_bytes_per_token > 0


def test_catalog_parameter_counts_agree_with_the_model_shapes():
    for name in ["llama-2-7b", "llama-3-8b", "llama-3-70b", "qwen2-72b", "mixtral-8x7b"]:
        m = get_model(name)
        assert m.shape_params() == pytest.approx(m.num_params, rel=0.03), name


def test_lamina_table3_weight_sizes_and_shapes():
    for name, gb, layers, d, g in [("llama-33b", 64.7, 60, 6656, 1), ("llama-65b", 130.1, 80, 8192, 1),
                                   ("llama3-70b", 137.5, 80, 8192, 8)]:
        m = get_model(name)
        assert (m.weight_bytes / 1e9, m.num_layers, m.hidden_size, m.r_gqa) == (gb, layers, d, g)


def test_a_dgx_machine_sums_its_eight_gpus_and_keeps_splitwise_machine_figures():
    a, h = get_hardware("dgx-a100"), get_hardware("dgx-h100")
    assert a.num_devices == 8 and a.mem_gb == 640 and a.fp16_tflops == 8 * 312
    assert a.mem_bw_gbs == 8 * 2039  # Splitwise Table I
    assert (a.price_per_hour, h.price_per_hour) == (17.6, 38.0)
    assert h.price_per_hour / a.price_per_hour == pytest.approx(2.16, abs=0.01)
    assert h.power_w / a.power_w == pytest.approx(1.75)
    assert get_hardware("dgx-h100-cap").power_w / a.power_w == pytest.approx(1.23, abs=0.01)
    assert h.nic_gbps / a.nic_gbps == 2


def test_user_catalog_files_add_and_override_entries(tmp_path, monkeypatch):
    extra = tmp_path / "mine.json"
    extra.write_text(json.dumps({
        "devices": {"h100": {"fp16_tflops": 1000, "mem_bw_gbs": 3000, "mem_gb": 80},
                    "my-npu": {"fp16_tflops": 50, "mem_bw_gbs": 500, "mem_gb": 16}},
        "models": {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                            "num_kv_heads": 2, "intermediate_size": 128}}}))
    assert get_hardware("my-npu", (str(extra),)).mem_gb == 16
    assert get_hardware("h100", (str(extra),)).fp16_tflops == 1000
    assert get_hardware("h100").fp16_tflops == 989
    monkeypatch.setenv(catalog.CATALOG_ENV, str(extra))
    assert get_model("tiny").num_params > 0
    monkeypatch.delenv(catalog.CATALOG_ENV)
    with pytest.raises(KeyError):
        get_model("tiny")


def test_unknown_names_fail_with_the_known_choices():
    with pytest.raises(KeyError, match="llama-2-70b"):
        get_model("gpt-5")
    with pytest.raises(KeyError, match="h100"):
        get_hardware("abacus")


SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
                "torch_dtype": "bfloat16"}


def test_a_hf_config_gives_smollm2_135m_its_exact_parameter_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    m = get_model(str(tmp_path / "config.json"))
    assert m.num_params == 134_515_008  # SmolLM2-135M: tied embeddings, no biases
    assert (m.r_gqa, m.kv_bytes_per_token) == (3, 2 * 30 * 192 * 2)


def test_the_tiny_test_llama_config_loads_as_a_model_spec(tiny_model_dir):
    m = ModelSpec.from_hf_config(f"{tiny_model_dir}/config.json")
    cfg = json.loads(open(f"{tiny_model_dir}/config.json").read())
    assert m.num_layers == cfg["num_hidden_layers"] and m.hidden_size == cfg["hidden_size"]
    assert m.dtype_bytes in (2, 4)


def test_h200_sits_beside_h100_with_its_memory_and_the_sm_count_the_gpu_kit_splits():
    h100, h200 = get_hardware("h100"), get_hardware("h200")
    assert h200.fp16_tflops == h100.fp16_tflops and h200.mem_bw_gbs / h100.mem_bw_gbs == pytest.approx(1.43, abs=0.01)
    assert h100.extra["num_sms"] == h200.extra["num_sms"] == 132
    assert get_hardware("dgx-h200").mem_gb == 8 * h200.mem_gb
