# SPDX-License-Identifier: Apache-2.0
"""The chaos report's router cuts: read from router log lines (the format of the soak's logs) and set
against the faults, so a cut of a working instance shows as `cuts_outside_faults`."""

from __future__ import annotations

import datetime

from vllm_disagg.testing.chaos.cuts import (
    cuts_outside_faults,
    router_cuts,
    router_suspects,
    slow_requests,
    ttft_split,
)

T0 = datetime.datetime(2026, 11, 27, 0, 0, 0).timestamp()


def _line(t_s: float, url: str, role: str, stalled_s: float) -> str:
    wall = datetime.datetime.fromtimestamp(T0 + t_s)
    return (f"{wall:%Y-%m-%d %H:%M:%S},{wall.microsecond // 1000:03d} WARNING vllm_disagg.router.health: dropping "
            f"instance {url} ({role}) from its pool: no progress for {stalled_s} s with 1 requests on it "
            "(adaptive limit 2.0 s)")


def test_cuts_are_read_from_every_router_and_checked_against_process_faults(tmp_path):
    (tmp_path / "router-0.log").write_text("\n".join([
        "2026-11-27 00:00:01,000 INFO vllm_disagg.router.health: instance http://d (decode) is healthy",
        _line(12.4, "http://d", "decode", 2.4),  # inside a SIGSTOP of D (10-20 s)
        _line(45.0, "http://d", "decode", 2.1),  # 15 s after attention0 was killed: waiting on its restart
        _line(200.0, "http://p", "prefill", 2.2),  # nothing was wrong then: a false cut
    ]))
    (tmp_path / "router-1.log").write_text(_line(12.6, "http://d", "decode", 2.6))
    faults = [{"kind": "stop", "target": "decode0", "t_start_s": 10.0, "t_end_s": 20.0},
              {"kind": "kill", "target": "attention0", "t_start_s": 30.0, "t_end_s": 30.0},
              {"kind": "bad_http", "target": "http://p", "t_start_s": 195.0, "t_end_s": 205.0}]
    cuts = router_cuts([tmp_path / "router-0.log", tmp_path / "router-1.log", tmp_path / "missing.log"], T0)
    assert [(c["t_s"], c["router"], c["role"], c["stalled_s"]) for c in cuts] == [
        (12.4, "router-0", "decode", 2.4), (12.6, "router-1", "decode", 2.6),
        (45.0, "router-0", "decode", 2.1), (200.0, "router-0", "prefill", 2.2)]
    assert [c["t_s"] for c in cuts_outside_faults(cuts, faults)] == [200.0]  # bad HTTP holds nothing up


def test_suspect_marks_are_read_like_cuts_with_the_soft_limit_as_their_stall(tmp_path):
    wall = datetime.datetime.fromtimestamp(T0 + 64.5)
    stamp = f"{wall:%Y-%m-%d %H:%M:%S},{wall.microsecond // 1000:03d}"
    (tmp_path / "router-0.log").write_text("\n".join([
        f"{stamp} WARNING vllm_disagg.router.health: instance http://d (decode) is suspect: its engine owes "
        "progress for 0.61 s (soft limit 0.50 s, 2 requests on it): moving those not started yet",
        f"{stamp} WARNING vllm_disagg.router.health: instance http://p (prefill) is suspect: no /live answer "
        "within 0.25 s (soft limit 0.75 s, 1 requests on it); no other instance can take them",
        _line(70.0, "http://d", "decode", 1.4),  # a cut is not a suspect mark
    ]))
    marks = router_suspects([tmp_path / "router-0.log"], T0)
    assert [(m["t_s"], m["role"], m["stalled_s"], m["num_requests"]) for m in marks] == [
        (64.5, "decode", 0.5, 2), (64.5, "prefill", 0.75, 1)]
    faults = [{"kind": "stop_engine", "target": "decode0", "t_start_s": 63.0, "t_end_s": 70.0}]
    assert len(cuts_outside_faults(marks, faults)) == 0 and len(cuts_outside_faults(marks, [])) == 2


def test_slow_requests_name_their_faults_and_whether_any_instance_could_serve():
    """The stop-25 soak's worst window: D killed (restarting for up to 60 s), then P's EngineCore
    stopped: nothing could serve, unlike a request that waited out a SIGSTOP of D alone."""
    faults = [{"kind": "kill", "target": "decode0", "t_start_s": 539.0, "t_end_s": 539.0},
              {"kind": "stop_engine", "target": "prefill0", "t_start_s": 554.7, "t_end_s": 563.6},
              {"kind": "stop_engine", "target": "decode0", "t_start_s": 619.8, "t_end_s": 627.6},
              {"kind": "bad_http", "target": "http://d", "t_start_s": 573.0, "t_end_s": 583.0}]
    outcomes = [{"key": "85/chat", "t_sent_s": 554.7, "ttft_s": 9.85},
                {"key": "3/completions", "t_sent_s": 620.2, "ttft_s": 7.71},
                {"key": "fast", "t_sent_s": 620.3, "ttft_s": 0.4}, {"key": "lost", "t_sent_s": 1.0, "ttft_s": None}]
    slow = slow_requests(outcomes, faults, ["prefill0", "decode0"], bound_s=1.5)
    assert [(s["key"], s["faults"], s["no_serving_instance"]) for s in slow] == [
        ("85/chat", ["kill decode0", "stop_engine prefill0"], True),
        ("3/completions", ["stop_engine decode0"], False)]


def test_a_request_in_flight_when_a_fault_starts_counts_as_during_it_not_as_quiet():
    """Seed 2 of stop 33: a request sent 2 ms before a stop_engine fault took 0.68 s; classified by
    send time it was quiet, and with 21 quiet requests it alone set the quiet P99."""
    outcomes = [{"t_sent_s": float(t), "ttft_s": 0.2, "latency_s": 0.3} for t in range(0, 40, 2)]
    outcomes += [{"t_sent_s": 43.127, "ttft_s": 0.68, "latency_s": 0.7},  # in flight at 43.129
                 {"t_sent_s": 60.0, "ttft_s": 2.0, "latency_s": 2.5},  # inside the fault
                 {"t_sent_s": 200.0, "ttft_s": 0.25, "latency_s": 0.3}]  # long after its aftermath
    result = {"faults": [{"kind": "stop_engine", "target": "decode0", "t_start_s": 43.129, "t_end_s": 53.3}],
              "outcomes": outcomes}
    ttft_split(result)
    assert [o["during_faults"] for o in outcomes[-3:]] == [True, True, False]
    assert result["p99_ttft_quiet_s"] == 0.25 and result["num_quiet_requests"] == 21
    assert result["p99_ttft_during_faults / p99_ttft_quiet"] == round(2.0 / 0.25, 3)


def test_a_kill_holds_its_target_until_it_was_back_when_that_was_measured():
    """Lamina on Ray, stop 41: P killed at 187 s served again 94 s later, and requests sent at 250 s while
    D was stopped had no serving instance; the fixed 60 s window said they had one."""
    kill = {"kind": "kill", "target": "prefill0", "t_start_s": 187.0, "t_end_s": 187.0}
    stop = {"kind": "stop", "target": "decode0", "t_start_s": 250.0, "t_end_s": 273.0}
    outcomes = [{"key": "16/chat", "t_sent_s": 252.0, "ttft_s": 18.4}]
    serving = ["prefill0", "decode0"]
    assert not slow_requests(outcomes, [kill, stop], serving, bound_s=1.5)[0]["no_serving_instance"]
    assert slow_requests(outcomes, [{**kill, "back_after_s": 94.0}, stop], serving, bound_s=1.5)[0]["no_serving_instance"]
    assert not slow_requests(outcomes, [{**kill, "back_after_s": 40.0}, stop], serving, bound_s=1.5)[0]["no_serving_instance"]
