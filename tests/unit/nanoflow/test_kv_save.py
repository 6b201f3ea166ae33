# SPDX-License-Identifier: Apache-2.0
"""The KV save gate: with nano-batches, a layer is saved once, after its last nano-batch."""

from __future__ import annotations

import threading

from vllm_disagg.nanoflow.kv_save import LayerSaveGate, install_gate


class Connector:
    """Records save_kv_layer calls, the way vLLM's attention wrapper makes them."""

    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self.saved.append(layer_name)


def _attention_calls(connector, layers: int, nano_batches: int) -> None:
    for li in range(layers):
        for _ in range(nano_batches):
            connector.save_kv_layer(f"model.layers.{li}.self_attn.attn", None, None)


def test_each_layer_is_saved_once_after_its_last_nano_batch():
    conn = Connector()
    gate = install_gate(conn)
    with gate.armed(2):
        conn.save_kv_layer("model.layers.0.self_attn.attn", None, None)
        assert conn.saved == [], "saved after the first of two nano-batches wrote the layer"
        conn.save_kv_layer("model.layers.0.self_attn.attn", None, None)
        assert conn.saved == ["model.layers.0.self_attn.attn"]
        _attention_calls(conn, 1, 0)
    conn.saved.clear()
    with gate.armed(4):
        _attention_calls(conn, 3, 4)
    assert conn.saved == [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def test_outside_nano_batched_steps_every_call_passes_through():
    conn = Connector()
    install_gate(conn)
    _attention_calls(conn, 2, 1)
    assert len(conn.saved) == 2
    with install_gate(conn).armed(1):
        _attention_calls(conn, 2, 1)
    assert len(conn.saved) == 4


def test_the_gate_is_installed_once_and_resets_between_steps():
    conn = Connector()
    gate = install_gate(conn)
    assert install_gate(conn) is gate and isinstance(conn.save_kv_layer, LayerSaveGate)
    with gate.armed(2):
        conn.save_kv_layer("l0", None, None)  # a step that ended early (error): one call only
    with gate.armed(2):
        conn.save_kv_layer("l0", None, None)
        assert conn.saved == [], "a count from the previous step leaked into this one"
        conn.save_kv_layer("l0", None, None)
    assert conn.saved == ["l0"]


def test_attention_on_several_unit_threads_still_saves_each_layer_once():
    conn = Connector()
    gate = install_gate(conn)
    with gate.armed(4):
        threads = [threading.Thread(target=_attention_calls, args=(conn, 8, 1)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(conn.saved) == sorted(f"model.layers.{i}.self_attn.attn" for i in range(8))


def test_only_connectors_that_save_whole_layers_are_gated():
    from vllm_disagg.kv.connector import DisaggConnector
    from vllm_disagg.nanoflow.kv_save import saves_whole_layers

    assert saves_whole_layers(DisaggConnector.__new__(DisaggConnector))
    assert not saves_whole_layers(Connector()), (
        "a per-call (slot-mapping) saver needs every nano-batch's call"
    )
