# SPDX-License-Identifier: Apache-2.0
"""Turn taking (nanoflow/pingpong.py): nano-batch threads send each layer's request in nano-batch
order whatever their timing (a request split across nano-batches needs its earlier tokens' KV of
that layer first), and run their waits in send order."""

from __future__ import annotations

import random
import threading
import time

from vllm_disagg.nanoflow.pingpong import _Rotation, _SendOrder

NUM_LAYERS, NUM_NANO = 4, 3


def _one_step(seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    rotation, order = _Rotation(NUM_NANO), _SendOrder()
    sent: list = []
    waited: list = []

    def wait(layer: int, i: int) -> None:
        time.sleep(rng.random() * 1e-3)  # the reply takes a while
        waited.append((layer, i))

    def body(i: int) -> None:
        rotation.acquire(i)
        try:
            for layer in range(NUM_LAYERS):
                time.sleep(rng.random() * 1e-3)  # this nano-batch's dense compute
                sent.append((layer, i))  # under the turn: one thread at a time
                ticket = order.take()
                rotation.release(i)
                order.run(ticket, lambda layer=layer: wait(layer, i))
                rotation.acquire(i)
        finally:
            rotation.release(i, finished=True)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(NUM_NANO)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return sent, waited


def test_each_layer_goes_out_in_nano_batch_order_and_waits_run_in_send_order():
    expected = [(layer, i) for layer in range(NUM_LAYERS) for i in range(NUM_NANO)]
    for seed in range(30):
        assert _one_step(seed) == (expected, expected)


def test_a_finished_nano_batch_leaves_the_rotation():
    rotation = _Rotation(3)
    rotation.acquire(0)
    rotation.release(0, finished=True)
    rotation.acquire(1)
    rotation.release(1)
    rotation.acquire(2)
    rotation.release(2)
    rotation.acquire(1)  # 0 is gone: 2 hands back to 1
    rotation.release(1, finished=True)
    rotation.acquire(2)
