# SPDX-License-Identifier: Apache-2.0
"""Small hand-made clusters with round-number timings for simulator tests."""

from __future__ import annotations

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec
from vllm_disagg.planner.profile import parse_profile

TINY = ModelSpec("tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                 intermediate_size=128, vocab_size=256)
# prefill 10 ms + 0.1 ms/token; decode 19 ms + 1 ms/request; KV 0.05 ms/token.
SIMPLE_PROFILE = {
    "prefill": [{"num_tokens": 0, "ms": 10.0}, {"num_tokens": 1000, "ms": 110.0}],
    "decode": [{"batch_size": 1, "ms": 20.0}, {"batch_size": 101, "ms": 120.0}],
    "kv_transfer": [{"num_tokens": 0, "ms": 0.0}, {"num_tokens": 1000, "ms": 50.0}],
}


def machine(kv_tokens: int, name: str = "box", overhead_ms: float = 2.0) -> HardwareSpec:
    """A machine whose memory holds exactly `kv_tokens` KV tokens of TINY."""
    mem = (TINY.weight_bytes + (kv_tokens + 0.5) * TINY.kv_bytes_per_token / 0.9) / 1e9
    return HardwareSpec(name, 1.0, 1.0, mem, nic_gbps=100, power_w=100, price_per_hour=1.0,
                        kv_layerwise_overhead_ms=overhead_ms)


def simple_profile():
    return parse_profile(SIMPLE_PROFILE)
