# SPDX-License-Identifier: Apache-2.0
"""Executor for a Lamina model worker: checks the attention servers before any model loads.

`DisaggAttentionExecutor(MultiprocExecutor)` (pass its qualname as `distributed_executor_backend`)
waits, bounded, until every configured attention server answers `/health` and fails with the
unreachable addresses otherwise; `check_health()` reports lost servers (the worker rebuilds their
requests on the next step, see `recovery.py`). It starts no servers itself: `launcher.py` or
`vllm-disagg attn-server` does. The worker class (`worker.py`) is what drops the local KV.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from vllm_disagg.attention.recovery import healthy
from vllm_disagg.config import disagg_config_from_vllm

logger = init_logger(__name__)


def wait_healthy(servers: list[str], timeout_s: float) -> list[str]:
    """Poll `/health` of each server until all answer or `timeout_s` passes; returns the missing."""
    deadline = time.monotonic() + timeout_s
    missing = list(servers)
    while missing:
        missing = [s for s in missing if not healthy(s)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return missing


class DisaggAttentionExecutor(MultiprocExecutor):
    """MultiprocExecutor that refuses to start without its attention servers."""

    def _init_executor(self) -> None:
        cfg = disagg_config_from_vllm(self.vllm_config)
        remote_attention = cfg.remote_attention if cfg else None
        if remote_attention is not None and remote_attention.servers:
            missing = wait_healthy(remote_attention.servers, remote_attention.timeout_s)
            if missing:
                raise RuntimeError(f"attention servers not reachable after {remote_attention.timeout_s}s: {missing}; "
                                   "start them with `vllm-disagg attn-server`")
        super()._init_executor()

    def check_health(self) -> None:
        super().check_health()
        cfg = disagg_config_from_vllm(self.vllm_config)
        if cfg and cfg.remote_attention:
            lost = [s for s in cfg.remote_attention.servers if not healthy(s)]
            if lost:
                logger.warning("attention servers not answering /health: %s", lost)
