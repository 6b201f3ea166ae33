# SPDX-License-Identifier: Apache-2.0
"""The mixed pool keyed on P's prompt queue in seconds of its measured rate (the router's default)."""

from vllm_disagg.router.policy import ClusterScheduler, Pool, SchedulerConfig
from vllm_disagg.router.prompt_rate import PromptRate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cls(clock: Clock, **cfg) -> ClusterScheduler:
    cls = ClusterScheduler(SchedulerConfig(**cfg), clock=clock)
    cls.add_instance("p0", Pool.PREFILL)
    cls.add_instance("d0", Pool.DECODE)
    return cls


def _measure(cls: ClusterScheduler, clock: Clock, tokens_per_s: float) -> None:
    """One 1000-token prompt prefilled on p0 at `tokens_per_s`, then nothing booked."""
    cls.pick("warm", 1000, 10)
    clock.now += 1000 / tokens_per_s
    cls.on_prefill_done("warm")
    cls.on_request_done("warm")
    clock.now += 60.0  # idle time is not prefill time


def test_the_rate_counts_busy_time_only_and_prompts_finishing_together_share_their_step():
    rate = PromptRate()
    assert rate.tokens_per_s is None and rate.seconds_for(1000) is None
    rate.on_busy(10.0)
    rate.on_prefill_done(600, 11.0)
    rate.on_prefill_done(400, 11.0)  # the same step
    rate.on_idle()
    rate.on_prefill_done(5000, 99.0)  # not busy: not a sample
    rate.on_busy(100.0)
    rate.on_prefill_done(1000, 101.0)
    assert rate.tokens_per_s == 1000.0  # 2000 tokens over 2 busy seconds
    assert rate.seconds_for(500) == 0.5


def test_token_thresholds_are_off_by_default_and_an_unmeasured_rate_never_overflows():
    clock = Clock()
    cls = _cls(clock)
    assert (cls.config.prefill_queue_threshold, cls.config.decode_queue_threshold) == (None, None)
    for i in range(20):  # 200k prompt tokens queued, no prefill finished yet
        decision = cls.pick(f"r{i}", 10_000, 100)
        assert (decision.prefill, decision.decode) == ("p0", "d0")


def test_past_the_colocate_limit_p_keeps_the_request_whole_and_goes_home_after():
    clock = Clock()
    cls = _cls(clock)
    _measure(cls, clock, tokens_per_s=500.0)
    assert cls.pick("a", 1500, 10).decode == "d0"  # queue ahead of it: 0 s
    assert cls.pick("b", 1000, 10).decode == "d0"  # 3 s
    c = cls.pick("c", 100, 10)  # 5 s > 4 s: its TTFT is long anyway, P decodes it too
    assert c.colocated and c.prefill == "p0" and c.decode_via_mixed and not c.prefill_via_mixed
    assert cls.instances["p0"].in_mixed_pool
    for rid in "abc":
        clock.now += 1.0
        cls.on_prefill_done(rid)
    cls.on_request_done("c")
    assert not cls.instances["p0"].in_mixed_pool


def test_past_the_prefill_limit_d_prefills_the_prompt():
    clock = Clock()
    cls = _cls(clock, colocate_queue_s=None)
    _measure(cls, clock, tokens_per_s=500.0)
    cls.pick("a", 4000, 10)  # 8 s of P's work
    assert cls.pick("b", 100, 10).prefill == "p0"  # 8 s is not past 8 s
    b = cls.pick("c", 100, 10)  # 8.2 s
    assert b.prefill == b.decode == "d0" and b.prefill_via_mixed


def test_the_limits_are_seconds_so_a_faster_instance_takes_a_longer_queue_in_tokens():
    clock = Clock()
    cls = _cls(clock)
    _measure(cls, clock, tokens_per_s=20_000.0)  # a GPU-like prefill rate
    decisions = [cls.pick(f"r{i}", 8192, 100) for i in range(10)]  # 73,728 tokens queued: 3.7 s
    assert all((d.prefill, d.decode) == ("p0", "d0") for d in decisions)
    assert cls.pick("late", 8192, 100).colocated  # 4.1 s
