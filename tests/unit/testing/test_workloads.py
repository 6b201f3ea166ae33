# SPDX-License-Identifier: Apache-2.0
"""The capacity benchmark's workload generator on known inputs."""

from __future__ import annotations

import random

import pytest

from vllm_disagg.testing.workloads import context_lengths, kv_bytes_per_token, long_context_requests


def test_contexts_are_spread_evenly_over_the_range_ends_included():
    assert context_lengths(5, 2048, 8192) == [2048, 3584, 5120, 6656, 8192]
    assert context_lengths(3, 2000, 2001) == [2000, 2000, 2001]  # Python rounds half to even
    assert context_lengths(1, 2048, 8192) == [8192]


def test_requests_interleave_short_and_long_and_decode_a_fixed_length():
    reqs = long_context_requests(5, 2048, 8192, output_len=256, vocab=1024, seed=7)
    assert [r.context for r in reqs] == [2048, 8192, 3584, 6656, 5120]
    assert [len(r.prompt_token_ids) for r in reqs] == [1792, 7936, 3328, 6400, 4864]
    assert all(r.max_tokens == 256 for r in reqs)
    assert all(3 <= t < 1024 for r in reqs for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 5  # no shared prefix to cache


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    a = long_context_requests(4, 100, 200, 10, vocab=50, seed=1)
    assert a == long_context_requests(4, 100, 200, 10, vocab=50, seed=1)
    assert a != long_context_requests(4, 100, 200, 10, vocab=50, seed=2)
    rng = random.Random(1)  # the first request's prompt is the first draws over [3, 50)
    assert a[0].prompt_token_ids == [rng.randrange(3, 50) for _ in range(90)]


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError):
        long_context_requests(4, 100, 200, output_len=100, vocab=50)
    with pytest.raises(ValueError):
        context_lengths(0, 100, 200)
    with pytest.raises(ValueError):
        context_lengths(2, 300, 200)


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    assert kv_bytes_per_token(8, 2, 64, 4) == 8192  # the capacity model, float32
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040  # SmolLM2, bfloat16
