# SPDX-License-Identifier: Apache-2.0
"""`other_vllm`: the patches see another vLLM version; afterwards they are applied again as on 0.32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

OTHER_VERSION = "0.33.1"


def _assert_refusal(err: BaseException, patch: str) -> None:
    """One line, naming the patch and both vLLM versions."""
    msg = str(err)
    assert "\n" not in msg, msg
    assert f"patch {patch}" in msg and "vLLM 0.32.x" in msg and f"vLLM {OTHER_VERSION}" in msg, msg


@pytest.fixture
def other_vllm(monkeypatch):
    pytest.importorskip("vllm")
    import vllm_disagg
    from vllm_disagg.patches import apply_all, compat

    monkeypatch.setattr(compat, "vllm_version", lambda: OTHER_VERSION)
    yield SimpleNamespace(version=OTHER_VERSION, assert_refusal=_assert_refusal)
    monkeypatch.undo()
    assert all(apply_all(vllm_disagg.patch_hooks()).values())
