# SPDX-License-Identifier: Apache-2.0
"""NanoFlow: nano-batch execution with op-level overlap on partitioned execution units.

Import-safe on any platform: the worker/runner classes (which import vLLM worker code) load lazily.
Start at README.md for the reading path.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "NanoFlowCPUWorker",
    "NanoFlowGPUWorker",
    "NanoFlowPlan",
    "NanoFlowRunnerMixin",
    "OpGraphExecutor",
]

_LAZY = {
    "NanoFlowCPUWorker": "vllm_disagg.nanoflow.worker",
    "NanoFlowGPUWorker": "vllm_disagg.nanoflow.worker",
    "NanoFlowRunnerMixin": "vllm_disagg.nanoflow.runner",
    "NanoFlowPlan": "vllm_disagg.nanoflow.plan",
    "OpGraphExecutor": "vllm_disagg.nanoflow.executor",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(importlib.import_module(_LAZY[name]), name)
