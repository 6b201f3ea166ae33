# SPDX-License-Identifier: Apache-2.0
"""P5: applies on 0.32, changes nothing until a nano-batch worker builds its runner, and is
skipped (with the nano-batch worker refusing) on another vLLM."""

import pytest

pytest.importorskip("vllm")

import vllm.v1.worker.cpu_worker as cpu_worker  # noqa: E402

from vllm_disagg.patches import PatchNotApplied, apply_one, require  # noqa: E402
from vllm_disagg.patches import cpu_worker_runner as patch  # noqa: E402


def test_applied_it_swaps_the_runner_class_for_one_call_only():
    original = cpu_worker.CPUModelRunner
    assert patch.apply()

    class Mine(original):
        pass

    with patch.building_cpu_runner(Mine):
        assert cpu_worker.CPUModelRunner is Mine
    assert cpu_worker.CPUModelRunner is original


def test_off_applying_changes_nothing():
    original = cpu_worker.CPUModelRunner
    assert patch.apply() and patch.apply()
    assert cpu_worker.CPUModelRunner is original


def test_skipped_on_another_vllm(other_vllm):
    assert not apply_one(patch.NAME)
    with pytest.raises(PatchNotApplied) as err:
        require("nano-batching", patch.NAME)
    other_vllm.assert_refusal(err.value, patch.NAME)
