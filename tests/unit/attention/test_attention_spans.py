# SPDX-License-Identifier: Apache-2.0
"""A sampled step of a traced request: `attention.step` on the model worker (layer 0 opens it and
sends its context with the step metadata, the last layer's answer ends it) and `attention.serve` on
the server under it, each with one event per layer. Steps without a sampled trace record nothing."""

from __future__ import annotations

import pytest
import torch
from retain_helpers import BS, GEOM, TOKEN, _step

from vllm_disagg.attention import spans as step_spans
from vllm_disagg.attention.client import DisaggAttentionClient
from vllm_disagg.attention.server import DisaggAttentionServer
from vllm_disagg.observe.context import TraceContext

PARENT = TraceContext(bytes(range(1, 17)), bytes(range(1, 9)), 1)


@pytest.fixture(scope="module")
def client():
    srv = DisaggAttentionServer(transport="tcp", kv_cache_bytes=8 << 20, auth_token=TOKEN)
    srv.start()
    cl = DisaggAttentionClient([srv.info()["http"]], transport="tcp", send_q_early=False, auth_token=TOKEN)
    cl.connect(**GEOM)
    yield cl
    cl.close()
    srv.stop()


def _step_through(client, trace):
    step_spans.set_step_trace(trace)
    meta = _step([3], 0, BS)
    out = torch.empty(BS, 4, 32)
    for layer in range(GEOM["num_layers"]):
        step_spans.begin_step(layer, meta)
        client.attend(layer, torch.randn(BS, 4, 32), torch.randn(BS, 2, 32), torch.randn(BS, 2, 32), meta, 0.2, out)
        step_spans.end_step(layer, GEOM["num_layers"], meta)
    step_spans.set_step_trace(None)


def test_a_sampled_step_is_a_worker_span_with_the_servers_span_under_it(client, spans):
    _step_through(client, PARENT)
    import time

    deadline = time.monotonic() + 5
    while len(spans()) < 2 and time.monotonic() < deadline:  # the server thread ends its span after replying
        time.sleep(0.01)
    by_name = {s.name: s for s in spans()}
    step, serve = by_name["attention.step"], by_name["attention.serve"]
    assert step.parent.span_id == int.from_bytes(PARENT.parent_span_id, "big")
    assert serve.parent.span_id == step.context.span_id and serve.context.trace_id == step.context.trace_id
    assert [e.attributes["disagg.layer"] for e in step.events] == [0, 1]
    assert [e.attributes["disagg.layer"] for e in serve.events] == [0, 1]


def test_unsampled_and_untraced_steps_record_nothing(client, spans):
    _step_through(client, None)
    _step_through(client, TraceContext(PARENT.trace_id, PARENT.parent_span_id, 0))
    assert spans() == ()
