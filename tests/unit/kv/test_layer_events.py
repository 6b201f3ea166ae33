# SPDX-License-Identifier: Apache-2.0
"""The per-layer event the KV sender waits on, through its CPU twin (`StreamTwin`).

On a GPU, `save_kv_layer` fires when a layer's KV write is queued on the forward stream, not done.
Here the "forward stream" is a `StreamTwin`: each layer's KV is written by an op that runs later on
the twin's thread. The sender must ship the layer as it is after that op, never before; the last
test shows the same setup without the event ships stale bytes, so the check can see the bug.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_kv_push import NUM_LAYERS, Pair, _until

from vllm_disagg.kv.layer_events import DONE, StreamTwin, device_events
from vllm_disagg.kv.metadata import SaveSpec


def test_cpu_kv_gets_the_completed_event_and_a_twin_event_completes_in_record_order():
    assert device_events(torch.device("cpu")).record() is DONE and DONE.wait(0) and DONE.query()
    stream = StreamTwin()
    gate = threading.Event()
    try:
        stream.submit(lambda: gate.wait(5))
        first, second = stream.record(), stream.record()
        assert not first.query() and not second.wait(0.05)
        gate.set()
        assert second.wait(5) and first.query()
    finally:
        gate.set()
        stream.close()


@pytest.fixture
def forward_pair():
    pair = Pair(threshold=0)
    for layer in pair.p_layers:
        layer.zero_()  # what the blocks hold before this step's kernels ran
    stream = StreamTwin()
    yield pair, stream
    stream.close()
    pair.close()


def _queue_layer_write(stream: StreamTwin, layer: torch.Tensor, value: float, delay_s: float) -> None:
    def write() -> None:
        time.sleep(delay_s)  # a slow kernel: the engine thread has long moved on
        layer.fill_(value)

    stream.submit(write)


def test_the_sender_reads_a_layer_only_after_the_event_behind_its_kv_write_completed(forward_pair):
    pair, stream = forward_pair
    pair.register("t1", [10, 11, 12, 13], num_tokens=64)
    pair.sender.bind(_metadata([SaveSpec("p1", (1, 2, 3, 4), 64, 64, "t1", True)]))
    gate = threading.Event()
    stream.submit(lambda: gate.wait(10))  # the stream is busy with earlier work
    for layer_idx, layer in enumerate(pair.p_layers):
        _queue_layer_write(stream, layer, float(layer_idx + 1), delay_s=0.05)
        pair.sender.layer_saved(layer_idx, stream.record())  # returns at once, like the CUDA hook
    pair.sender.step_done(stream.record())
    time.sleep(0.2)  # registered, every layer "saved", no kernel run yet: nothing may have been sent
    assert not any(d.any() for d in pair.d_layers) and not pair.poll()
    gate.set()
    assert _until(pair.poll, timeout=10) == {"d-t1"} and not pair.failed
    for layer_idx in range(NUM_LAYERS):
        assert torch.all(pair.d_layers[layer_idx][10:14] == layer_idx + 1), f"layer {layer_idx} shipped stale"
    assert not stream.errors


def test_layers_are_shipped_one_by_one_as_their_events_complete(forward_pair):
    pair, stream = forward_pair
    pair.register("t1", [10, 11], num_tokens=32)
    pair.sender.bind(_metadata([SaveSpec("p1", (1, 2), 32, 32, "t1", True)]))
    gate = threading.Event()
    _queue_layer_write(stream, pair.p_layers[0], 1.0, delay_s=0.0)
    pair.sender.layer_saved(0, stream.record())
    stream.submit(lambda: gate.wait(10))  # layer 1's kernel is stuck until the gate opens
    _queue_layer_write(stream, pair.p_layers[1], 2.0, delay_s=0.0)
    pair.sender.layer_saved(1, stream.record())
    _until(lambda: torch.all(pair.d_layers[0][10:12] == 1.0))
    time.sleep(0.1)
    assert not pair.d_layers[1].any(), "layer 1 was read before its event completed"
    gate.set()
    _queue_layer_write(stream, pair.p_layers[2], 3.0, delay_s=0.0)
    pair.sender.layer_saved(2, stream.record())
    pair.sender.step_done(stream.record())
    assert _until(pair.poll) == {"d-t1"}
    assert all(torch.all(pair.d_layers[i][10:12] == i + 1) for i in range(NUM_LAYERS))


def test_without_the_event_the_same_step_ships_stale_kv(forward_pair):
    """Negative control: what the event prevents (the pre-event behaviour, DONE at once)."""
    pair, stream = forward_pair
    pair.register("t1", [10, 11], num_tokens=32)
    pair.sender.bind(_metadata([SaveSpec("p1", (1, 2), 32, 32, "t1", True)]))
    for layer_idx, layer in enumerate(pair.p_layers):
        _queue_layer_write(stream, layer, float(layer_idx + 1), delay_s=0.3)
        pair.sender.layer_saved(layer_idx, DONE)
    pair.sender.step_done(DONE)
    assert _until(pair.poll) == {"d-t1"}
    stream.synchronize()
    assert not pair.d_layers[NUM_LAYERS - 1][10:12].any(), "expected the stale (pre-kernel) bytes"


def _metadata(specs):
    from vllm_disagg.kv.metadata import DisaggConnectorMetadata

    return DisaggConnectorMetadata(save_specs=specs)
