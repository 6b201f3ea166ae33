# SPDX-License-Identifier: Apache-2.0
"""Attention-server loss inside a nano-batched step: what recovery relies on from the executor (the
loss surfaces on the caller's thread, unwrapped, after every unit stopped; the executor runs the next
step normally) and the wrapper's control flow (outermost only, bounded retries). The end-to-end case
with real servers killed mid-decode: tests/integration/test_nanoflow_remote.py."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_disagg.attention import recovery
from vllm_disagg.attention.client import AttentionServerLost
from vllm_disagg.nanoflow.executor import OpGraphExecutor
from vllm_disagg.nanoflow.graph import NET, PipelineSpec, build_graph, list_schedule
from vllm_disagg.nanoflow.units import make_cpu_units


def test_a_server_lost_on_the_net_unit_reaches_the_caller_unwrapped_once_every_unit_stopped():
    nodes = build_graph(PipelineSpec(2, 2, 2, attn_unit=NET))  # n=2 ping-pong: attention on "net"
    sched = list_schedule(nodes, lambda n: 1.0)
    lost = AttentionServerLost("127.0.0.1:1", ConnectionResetError("peer closed"))
    spans, lock = {}, threading.Lock()

    def op(key):
        def fn():
            t0 = time.monotonic()
            if key == ("attn", 0, 0):
                time.sleep(0.05)
                raise lost  # the RPC of nano-batch 0 finds its server dead...
            time.sleep(0.2 if key == ("kqv", 0, 1) else 0.0)  # ...while nano-batch 1's dense op runs
            with lock:
                spans[key] = (t0, time.monotonic())

        return fn

    ex = OpGraphExecutor(make_cpu_units({"dense": 0, "net": 0}), exclusive_units={"dense"})
    try:
        with pytest.raises(AttentionServerLost) as info:
            ex.run(nodes, sched, {n.key: op(n.key) for n in nodes})
        returned = time.monotonic()
        assert info.value is lost  # the same exception: `except AttentionServerLost` recovers it
        assert ("kqv", 0, 1) in spans  # the op in flight on the other unit finished first...
        assert all(end <= returned for _, end in spans.values())  # ...and nothing ran after the return
        assert not any(k[1] == 1 for k in spans)  # no op of a later layer started after the loss
        before = dict(spans)
        time.sleep(0.1)
        assert spans == before  # no unit kept running the failed step's ops
        spans.clear()
        ex.run(nodes, sched, {n.key: (op(n.key) if n.key != ("attn", 0, 0) else (lambda: None)) for n in nodes})
        assert len(spans) == len(nodes) - 1 and not set(before) - set(spans)  # the re-run is whole
    finally:
        ex.shutdown()


class _Runner:
    """The attributes `forward_with_recovery` uses; `forward` fails the first `failures` calls."""

    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0

    def forward(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise AttentionServerLost("127.0.0.1:1", ConnectionResetError(f"call {self.calls}"))
        return "logits"


def test_recovery_runs_once_at_the_outermost_wrapper_and_the_step_is_re_run(monkeypatch):
    runner, recovered = _Runner(failures=1), []
    monkeypatch.setattr(recovery, "recover", lambda r, err: recovered.append((r, str(err))))

    def inner():  # the stock remote runner's own wrapper, nested under the nano-batch runner's
        return recovery.forward_with_recovery(runner, runner.forward)

    assert recovery.forward_with_recovery(runner, inner) == "logits"
    assert runner.calls == 2 and recovered == [(runner, "attention server 127.0.0.1:1: call 1")]
    assert runner._recovery_active is False  # the next step recovers again


def test_a_step_gives_up_after_max_attempts_losses_in_a_row(monkeypatch):
    runner, recovered = _Runner(failures=recovery.MAX_ATTEMPTS), []
    monkeypatch.setattr(recovery, "recover", lambda r, err: recovered.append(err))
    with pytest.raises(AttentionServerLost, match=f"call {recovery.MAX_ATTEMPTS}"):
        recovery.forward_with_recovery(runner, runner.forward)
    assert runner.calls == recovery.MAX_ATTEMPTS and len(recovered) == recovery.MAX_ATTEMPTS - 1
    assert runner._recovery_active is False
