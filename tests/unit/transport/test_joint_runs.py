# SPDX-License-Identifier: Apache-2.0
"""`kv_common.joint_runs` and `kv_common.runs` (the stream backends' run planners, numpy ids, with a
list-comparison fast path for one short run) give exactly what the one-sided backends' pure-python
`block_runs` gives, on both sides of the fast path's size bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_disagg.transport.kv_common import _SMALL_RUN_CHECK, joint_runs, runs
from vllm_disagg.transport.onesided.runs import block_runs


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=60))
def test_joint_runs_equals_the_pure_python_twin(pairs):
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    assert joint_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)) == block_runs(src, dst)


@given(st.integers(0, 1000), st.integers(0, 1000), st.sampled_from([1, 2, _SMALL_RUN_CHECK, _SMALL_RUN_CHECK + 1]),
       st.integers(-1, _SMALL_RUN_CHECK + 1))
def test_one_run_and_one_break_at_any_length(first_src, first_dst, num, break_at):
    src = np.arange(first_src, first_src + num, dtype=np.int64)
    dst = np.arange(first_dst, first_dst + num, dtype=np.int64)
    if 0 < break_at < num:
        dst[break_at:] += 5  # the destination jumps: two runs
    got = joint_runs(src, dst)
    assert got == block_runs(src.tolist(), dst.tolist())
    assert len(got) == (2 if 0 < break_at < num else 1)


@given(st.lists(st.integers(0, 50), max_size=60), st.sampled_from([np.int64, np.dtype("<u4")]))
def test_runs_of_one_id_list_are_the_twin_s_runs_with_positions(ids, dtype):
    """`runs` (tcp's sender and the receiver, which parses ids as uint32) against `block_runs` of the
    ids paired with their positions."""
    expected = [(pos, first, n) for first, pos, n in block_runs(ids, list(range(len(ids))))]
    assert runs(np.array(ids, dtype=dtype)) == expected


@pytest.mark.parametrize("num", [1, _SMALL_RUN_CHECK, _SMALL_RUN_CHECK + 1])
def test_runs_of_one_run_and_of_a_wrapped_uint32_pair(num):
    assert runs(np.arange(7, 7 + num, dtype=np.dtype("<u4"))) == [(0, 7, num)]
    assert runs(np.array([0xFFFFFFFF, 0], dtype=np.dtype("<u4"))) == [(0, 0xFFFFFFFF, 1), (1, 0, 1)]
