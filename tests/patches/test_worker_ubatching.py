# SPDX-License-Identifier: Apache-2.0
"""P7: applies on 0.32, sets only the worker's copy of the ubatch fields, skipped on another vLLM."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import ParallelConfig  # noqa: E402

from vllm_disagg.patches import PatchNotApplied, apply_one, require  # noqa: E402
from vllm_disagg.patches import worker_ubatching as patch  # noqa: E402


def test_applied_it_sets_the_three_fields():
    assert patch.apply()
    pc = SimpleNamespace(ubatch_size=0, dbo_decode_token_threshold=32, dbo_prefill_token_threshold=512)
    patch.set_worker_ubatching(pc, 3)
    assert (pc.ubatch_size, pc.dbo_decode_token_threshold, pc.dbo_prefill_token_threshold) == (3, 3, 3)


def test_off_applying_leaves_vllm_defaults_alone():
    assert patch.apply()
    pc = ParallelConfig()
    assert pc.ubatch_size in (0, 1) and pc.dbo_decode_token_threshold == 32 and not pc.use_ubatching


def test_skipped_on_another_vllm(other_vllm):
    assert not apply_one(patch.NAME)
    with pytest.raises(PatchNotApplied) as err:
        require("nano-batching", patch.NAME)
    other_vllm.assert_refusal(err.value, patch.NAME)
