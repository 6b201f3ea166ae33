# SPDX-License-Identifier: Apache-2.0
"""P8: the attention-backend selector forgets what an earlier in-process engine chose.

Upstream (vLLM 0.32): `vllm/v1/attention/selector.py:_cached_get_attn_backend` (an lru_cache).
Reason: the CPU_ATTN override resolves to the remote backend or the stock one from the engine's
config, but the selector caches the class per process, keyed without the config: an engine built
after another one in the same process (benchmarks' A/B pairs, tests) would get the first one's.
Delta: `clear_attn_backend_cache()` calls its `cache_clear()` when a remote-attention worker starts
and shuts down.
No-op unless a remote-attention worker runs; when the patch did not apply it clears nothing.
Removal plan: when the selector keys its cache on the backend registry or the config.
"""

from __future__ import annotations

from vllm_disagg.patches import is_applied
from vllm_disagg.patches.compat import mark_skipped, version_ok

NAME = "attn_backend_cache"
UPSTREAM = "vllm/v1/attention/selector.py:_cached_get_attn_backend"


def apply(hooks=None) -> bool:
    if not version_ok(NAME):
        return False
    import vllm.v1.attention.selector as selector

    if not hasattr(getattr(selector, "_cached_get_attn_backend", None), "cache_clear"):
        mark_skipped(NAME, "vllm.v1.attention.selector has no cached _cached_get_attn_backend")
        return False
    return True


def clear_attn_backend_cache() -> None:
    if not is_applied(NAME):
        return
    from vllm.v1.attention.selector import _cached_get_attn_backend

    # ### PATCH START
    _cached_get_attn_backend.cache_clear()
    # ### PATCH END
