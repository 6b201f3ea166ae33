# SPDX-License-Identifier: Apache-2.0
"""The A/B overhead diagnostic: matched token counts only, wall and CPU time, heaviest counts."""

from __future__ import annotations

from vllm_disagg.nanoflow.throughput import PairedSteps


def _feed(ab: PairedSteps, tokens: int, plain_s: float, nano_s: float, steps: int, cpu: bool = True) -> None:
    for _ in range(steps):
        which = "nano" if ab.choose_nano(tokens) else "plain"
        secs = nano_s if which == "nano" else plain_s
        ab.record(which, tokens, secs, secs * 0.9 if cpu else None)


def test_steps_of_each_token_count_alternate_between_nano_and_plain():
    ab = PairedSteps()
    assert [ab.choose_nano(64) for _ in range(4)] == [True, False, True, False]
    assert ab.choose_nano(8) is True, "each token count alternates on its own"


def test_only_token_counts_seen_both_ways_enter_the_ratio():
    ab = PairedSteps()
    _feed(ab, 256, plain_s=0.10, nano_s=0.11, steps=10)
    ab.choose_nano(3)
    ab.record("nano", 3, 5.0, 5.0)  # seen nano-batched only: must not count
    out = ab.summary()
    assert out["matched_steps"] == 10
    assert abs(out["nano_over_plain"] - 0.10 / 0.11) < 1e-9
    assert abs(out["nano_over_plain_cpu_time"] - 0.10 / 0.11) < 1e-9
    assert out["top_token_counts"][0]["tokens"] == 256


def test_the_heaviest_token_counts_are_listed_first_with_their_own_ratios():
    ab = PairedSteps()
    _feed(ab, 512, plain_s=0.2, nano_s=0.2, steps=20)
    _feed(ab, 12, plain_s=0.01, nano_s=0.02, steps=20)
    top = ab.summary()["top_token_counts"]
    assert [row["tokens"] for row in top] == [512, 12]
    assert top[0]["nano_over_plain"] == 1.0 and top[1]["nano_over_plain"] == 0.5


def test_cpu_time_is_reported_only_when_every_step_had_it():
    ab = PairedSteps()
    _feed(ab, 64, plain_s=0.1, nano_s=0.1, steps=4, cpu=False)
    out = ab.summary()
    assert out["nano_over_plain"] == 1.0
    assert out["nano_over_plain_cpu_time"] is None
    assert out["top_token_counts"][0]["nano_over_plain_cpu_time"] is None


def test_reset_starts_counters_and_ab_buckets_over_after_a_warm_up():
    from types import SimpleNamespace

    from vllm_disagg.nanoflow.runner import reset_runner_stats, runner_stats

    ab = PairedSteps()
    _feed(ab, 8, plain_s=0.1, nano_s=0.2, steps=4)  # warm-up steps
    runner = SimpleNamespace(nano_stats={"steps": 7, "pipeline_steps": 5}, _nano_tput=None, _nano_ab=ab)
    reset_runner_stats(runner)
    assert runner.nano_stats == {"steps": 0, "pipeline_steps": 0}
    assert runner._nano_ab is not ab and runner._nano_ab.summary() is None
    assert "ab" not in runner_stats(runner)
