# SPDX-License-Identifier: Apache-2.0
"""KV connector save hooks under nano-batching: a layer is saved once all nano-batches wrote it.

vLLM calls `connector.save_kv_layer(layer_name, ...)` after each attention layer (the
`maybe_transfer_kv_layer` wrapper). With nano-batches, attention runs once per nano-batch per layer,
so the hook fires after the *first* nano-batch has written only its own rows of that layer. A
layer-wise push (Splitwise, `vllm_disagg.kv`) taken at that point reads stale KV for the tokens of
the later nano-batches (tests/integration/test_pd_connector.py counted 46 stale block writes in one
run without this gate, 0 with it). `LayerSaveGate` forwards a layer's save only on its last
nano-batch's call, when every row of the step has been written; `wait_for_save` at the end of the
forward is unchanged. The gate passes calls straight through outside nano-batched steps.
More: README.md, "kv_save.py".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class LayerSaveGate:
    """Wraps one connector's `save_kv_layer`; `armed(n)` covers one nano-batched step."""

    def __init__(self, save: Callable[..., Any]) -> None:
        self._save = save
        self._lock = threading.Lock()
        self._expected = 0
        self._seen: dict[str, int] = {}

    def __call__(self, layer_name: str, *args: Any, **kwargs: Any) -> Any:
        if self._expected <= 1:
            return self._save(layer_name, *args, **kwargs)
        with self._lock:
            seen = self._seen[layer_name] = self._seen.get(layer_name, 0) + 1
        if seen == self._expected:  # the last nano-batch of this layer: the layer is complete
            return self._save(layer_name, *args, **kwargs)
        return None

    @contextmanager
    def armed(self, nano_batches: int) -> Iterator[None]:
        with self._lock:
            self._expected, self._seen = nano_batches, {}
        try:
            yield
        finally:
            with self._lock:
                self._expected, self._seen = 0, {}


def install_gate(connector: Any) -> LayerSaveGate:
    """The gate on `connector` (created on first use; the instance attribute shadows the method)."""
    gate = connector.__dict__.get("save_kv_layer")
    if not isinstance(gate, LayerSaveGate):
        gate = LayerSaveGate(connector.save_kv_layer)
        connector.save_kv_layer = gate
    return gate


@contextmanager
def nano_batched_saves(nano_batches: int) -> Iterator[None]:
    """Around one nano-batched forward: gate the active KV connector's layer saves, if any."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if nano_batches > 1 and has_kv_transfer_group() else None
    if connector is None or not saves_whole_layers(connector):
        yield
        return
    with install_gate(connector).armed(nano_batches):
        yield


def saves_whole_layers(connector: Any) -> bool:
    """True for connectors whose `save_kv_layer(name)` means "layer `name` is written for every
    request of this step" (see module docstring)."""
    from vllm_disagg.kv.connector import DisaggConnector

    return isinstance(connector, DisaggConnector)
