# SPDX-License-Identifier: Apache-2.0
"""P8: applies on 0.32 and clears the selector cache; off or skipped, it clears nothing."""

import functools

import pytest

pytest.importorskip("vllm")

import vllm.v1.attention.selector as selector  # noqa: E402

from vllm_disagg.patches import PatchNotApplied, apply_one, require  # noqa: E402
from vllm_disagg.patches import attn_backend_cache as patch  # noqa: E402


@pytest.fixture
def fake_cache(monkeypatch):
    @functools.lru_cache
    def cached(x):
        return x

    cached(1)
    monkeypatch.setattr(selector, "_cached_get_attn_backend", cached)
    return cached


def test_applied_it_clears_the_cache(fake_cache):
    assert apply_one(patch.NAME)
    patch.clear_attn_backend_cache()
    assert fake_cache.cache_info().currsize == 0


def test_off_applying_keeps_the_cache(fake_cache):
    assert apply_one(patch.NAME)
    assert fake_cache.cache_info().currsize == 1


def test_skipped_on_another_vllm_it_clears_nothing(other_vllm, fake_cache):
    assert not apply_one(patch.NAME)
    patch.clear_attn_backend_cache()
    assert fake_cache.cache_info().currsize == 1
    with pytest.raises(PatchNotApplied) as err:
        require("remote attention", patch.NAME)
    other_vllm.assert_refusal(err.value, patch.NAME)
