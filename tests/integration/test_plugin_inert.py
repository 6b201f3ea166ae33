# SPDX-License-Identifier: Apache-2.0
"""With the plugin installed but unused, vLLM's output is byte-identical to vLLM without it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("generate_script.py")


def generate(model: str, tmp_path: Path, name: str, plugins: str | None, disagg: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(SCRIPT), model, str(out)] + ([json.dumps(disagg)] if disagg is not None else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inert")
    return {
        "without": generate(smollm2_dir, tmp, "without", plugins=""),
        "unused": generate(smollm2_dir, tmp, "unused", plugins=None),
        "empty_config": generate(smollm2_dir, tmp, "empty", plugins=None, disagg={}),
    }


def test_the_plugin_is_loaded_only_when_allowed(runs):
    assert not runs["without"]["plugin_loaded"] and not runs["without"]["patched"]
    assert runs["unused"]["plugin_loaded"] and runs["unused"]["patched"]


def test_installed_but_unused_plugin_gives_byte_identical_output(runs):
    assert json.dumps(runs["unused"]["outputs"]) == json.dumps(runs["without"]["outputs"])


def test_an_empty_disagg_config_changes_nothing(runs):
    assert json.dumps(runs["empty_config"]["outputs"]) == json.dumps(runs["without"]["outputs"])


def test_the_embedded_model_answers_sensibly(runs):
    text = runs["without"]["outputs"][0][0]
    assert "Paris" in text
