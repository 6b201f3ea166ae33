# SPDX-License-Identifier: Apache-2.0
"""Fail closed: `apply_all()` says what applied, and every feature refuses to start, in one line
naming the patch and both vLLM versions, when a patch it declared did not apply."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm_disagg  # noqa: E402
from vllm_disagg.patches import DEFERRED, ON_DEMAND, PATCHES, PatchNotApplied, applied, apply_all, require  # noqa: E402


def feature_requirements() -> dict[str, tuple[str, ...]]:
    from vllm_disagg.attention import worker as attention_worker
    from vllm_disagg.kv import connector
    from vllm_disagg.nanoflow import runner

    return {
        "remote attention": attention_worker.REQUIRED_PATCHES,
        "nano-batching": runner.REQUIRED_PATCHES + ("cpu_worker_runner",),
        "nano-batching with remote attention": ("runner_class_swap",),
        "the KV consumer": connector.CONSUMER_PATCHES,
        "vllm-disagg serve --plugin disagg": ("cli_plugin_flag", "engine_config_wiring"),
    }


def test_register_returns_what_applied_and_everything_applies_on_0_32():
    import importlib

    results = vllm_disagg.register()
    assert set(PATCHES) - set(DEFERRED) <= set(results) and all(results.values()), results
    for module in DEFERRED.values():  # an engine process imports these; each patch applies then
        importlib.import_module(module)
    results = applied()
    assert set(results) == set(PATCHES) and all(results.values()), results
    for feature, names in feature_requirements().items():
        assert set(names) <= set(PATCHES + ON_DEMAND), feature
        require(feature, *names)  # does not raise


def test_on_another_vllm_every_patch_is_skipped_and_every_feature_refuses(other_vllm):
    results = apply_all(vllm_disagg.patch_hooks())
    assert not any(results.values()), results
    for feature, names in feature_requirements().items():
        with pytest.raises(PatchNotApplied) as err:
            require(feature, *names)
        other_vllm.assert_refusal(err.value, names[0])
        assert str(err.value).startswith(f"vllm-disagg: {feature} needs patch {names[0]} (vllm/")


def test_an_unknown_patch_name_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown patch"):
        require("x", "no_such_patch")


def test_nano_batching_refuses_before_touching_the_config(other_vllm):
    from vllm_disagg.nanoflow.runner import enable_nano_ubatching

    apply_all(vllm_disagg.patch_hooks())
    pc = SimpleNamespace(data_parallel_size=1, enable_dbo=False, pipeline_parallel_size=1, ubatch_size=0)
    cfg = SimpleNamespace(additional_config={"disagg": {"nanoflow": {"nano_batches": 2}}}, parallel_config=pc,
                          model_config=SimpleNamespace(model="m"))
    with pytest.raises(PatchNotApplied) as err:
        enable_nano_ubatching(cfg)
    other_vllm.assert_refusal(err.value, "worker_ubatching")
    assert pc.ubatch_size == 0


def test_llm_with_a_disagg_config_refuses_instead_of_running_stock_vllm(other_vllm, tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_disagg.patches import engine_config_wiring

    assert not engine_config_wiring.apply(vllm_disagg.patch_hooks())
    args = EngineArgs(model=tiny_model_dir, additional_config={"disagg": {"nanoflow": {"nano_batches": 2}}})
    with pytest.raises(PatchNotApplied) as err:
        args.create_engine_config()
    other_vllm.assert_refusal(err.value, "engine_config_wiring")
    assert args.worker_cls == "auto"  # nothing was wired


def test_vllm_disagg_serve_refuses_in_one_line(other_vllm, capsys, monkeypatch):
    from vllm_disagg.cli import serve

    monkeypatch.setattr(vllm_disagg, "_registered", False)
    assert serve.run_vllm_serve(["/nonexistent-model-dir"]) == 2
    line = capsys.readouterr().err.strip()
    other_vllm.assert_refusal(line, "cli_plugin_flag")


def test_an_api_server_process_does_not_import_the_engine_modules_the_deferred_patches_target():
    """In a fresh interpreter: `register()` after what `vllm serve`'s API server imports leaves the
    scheduler and the CPU worker unimported; importing one applies its patch there and then."""
    script = """
import sys
import vllm.entrypoints.openai.api_server
import vllm_disagg
from vllm_disagg.patches import DEFERRED, applied
vllm_disagg.register()
assert not set(DEFERRED.values()) & set(sys.modules), set(DEFERRED.values()) & set(sys.modules)
assert not set(DEFERRED) & set(applied()), applied()
from vllm.v1.core.sched.scheduler import Scheduler
assert applied()["scheduler_fatal_kv_failure"] is True
assert hasattr(Scheduler, "_vllm_disagg_original_update_from_output")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
