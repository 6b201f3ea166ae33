# SPDX-License-Identifier: Apache-2.0
"""serve_bench's TTFT breakdown (benchmarks/serve_run.py ttft_breakdown) on known histogram deltas:
the stages add up to the client's mean TTFT, and the time a request waits for the engine's step in
flight (which vLLM's queue histogram does not count) is its own stage, not part of the handoff."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serve_run import ttft_breakdown  # noqa: E402


def _hist(num: int, **mean_s: float) -> dict:
    names = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
             "ttft": "vllm:time_to_first_token_seconds"}
    out = {}
    for key, mean in mean_s.items():
        out[f"{names[key]}_sum"], out[f"{names[key]}_count"] = mean * num, float(num)
    return out


def test_pd_stages_add_up_to_the_client_ttft_and_the_wait_is_not_handoff():
    # 10 requests: P waits 0.3 s for the step in flight, queues 1 ms, prefills 1.7 s; D's first step 60 ms
    d = {"prefill": _hist(10, queue=0.001, prefill=1.7, ttft=2.001),
         "decode": _hist(10, queue=2.0, prefill=0.06, ttft=2.07)}
    out = ttft_breakdown(d, {"ttft_mean_ms": 2070.0, "ttft_p50_ms": 2000.0})
    assert out["prefill_wait_for_step_ms"] == pytest.approx(300.0)
    assert out["handoff_ms"] == pytest.approx(9.0)  # 2070 - (300 + 1 + 1700 + 60)
    assert "decode_wait_for_step_ms" not in out  # D's queue already spans P's whole prefill
    stages = ("prefill_wait_for_step_ms", "prefill_queue_ms", "prefill_prefill_ms", "handoff_ms",
              "decode_prefill_ms")
    assert sum(out[k] for k in stages) == pytest.approx(out["client_ttft_mean_ms"])


def test_plain_gets_its_wait_and_no_handoff():
    out = ttft_breakdown({"plain": _hist(4, queue=0.0, prefill=0.9, ttft=1.03)}, {"ttft_mean_ms": 1040.0})
    assert out["plain_wait_for_step_ms"] == pytest.approx(130.0)
    assert "handoff_ms" not in out


def test_a_missing_histogram_leaves_the_wait_and_handoff_unknown():
    d = {"prefill": _hist(10, queue=0.001, prefill=1.7), "decode": _hist(10, prefill=0.06)}
    out = ttft_breakdown(d, {"ttft_mean_ms": 2070.0})
    assert out["prefill_wait_for_step_ms"] is None
    assert "handoff_ms" not in out
