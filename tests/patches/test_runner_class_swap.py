# SPDX-License-Identifier: Apache-2.0
"""P6: applies on 0.32, swaps only to a compatible subclass, and is skipped on another vLLM."""

import pytest

pytest.importorskip("vllm")

from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402

from vllm_disagg.patches import PatchNotApplied, apply_one, require  # noqa: E402
from vllm_disagg.patches import runner_class_swap as patch  # noqa: E402


class Built(CPUModelRunner):
    def __init__(self):  # no engine: only the class matters here
        self.attr = 1


class Plugin(Built):
    pass


class Slotted(Built):
    __slots__ = ("x",)


def test_applied_a_built_runner_becomes_the_subclass_and_keeps_its_state():
    assert patch.apply()
    runner = Built()
    patch.swap_runner_class(runner, Plugin)
    assert type(runner) is Plugin and runner.attr == 1


def test_an_unrelated_or_slotted_class_is_refused():
    runner = Built()
    with pytest.raises(TypeError, match="not a subclass"):
        patch.swap_runner_class(runner, CPUModelRunner)
    with pytest.raises(TypeError, match="__slots__"):
        patch.swap_runner_class(runner, Slotted)
    assert type(runner) is Built


def test_off_applying_touches_no_class():
    before = dict(vars(CPUModelRunner))
    assert patch.apply()
    assert dict(vars(CPUModelRunner)) == before


def test_skipped_on_another_vllm(other_vllm):
    assert not apply_one(patch.NAME)
    with pytest.raises(PatchNotApplied) as err:
        require("remote attention", patch.NAME)
    other_vllm.assert_refusal(err.value, patch.NAME)
