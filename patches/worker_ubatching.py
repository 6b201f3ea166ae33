# SPDX-License-Identifier: Apache-2.0
"""P7: a worker turns on vLLM's ubatch plumbing for a dense model after the config was validated.

Upstream (vLLM 0.32): `vllm/config/parallel.py:ParallelConfig.ubatch_size`,
`dbo_decode_token_threshold`, `dbo_prefill_token_threshold`.
Reason: `VllmConfig.__post_init__` asserts an all2all (MoE) backend whenever ubatching is on, so a
dense model cannot ask for it in the config; the nano-batch runner reuses the ubatch slicing and
per-slice attention metadata as-is.
Delta: `set_worker_ubatching(parallel_config, n)` sets the three fields on the worker's own copy
of the config, after validation and before the runner is built.
No-op unless nano-batching is configured with 2+ nano-batches.
Removal plan: when vLLM allows ubatching for dense models (or exposes a split-point hook).
"""

from __future__ import annotations

from typing import Any

from vllm_disagg.patches.compat import mark_skipped, version_ok

NAME = "worker_ubatching"
UPSTREAM = "vllm/config/parallel.py:ParallelConfig.ubatch_size"


def apply(hooks=None) -> bool:
    if not version_ok(NAME):
        return False
    from vllm.config import ParallelConfig

    fields = getattr(ParallelConfig, "__dataclass_fields__", {})
    missing = [f for f in ("ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold")
               if f not in fields]
    if missing:
        mark_skipped(NAME, f"ParallelConfig has no {', '.join(missing)}")
        return False
    return True


def set_worker_ubatching(parallel_config: Any, num_ubatches: int) -> None:
    """Split every step into `num_ubatches` (call `require` first)."""
    # ### PATCH START
    parallel_config.ubatch_size = num_ubatches
    parallel_config.dbo_decode_token_threshold = max(num_ubatches, 1)
    parallel_config.dbo_prefill_token_threshold = max(num_ubatches, 1)
    # ### PATCH END
