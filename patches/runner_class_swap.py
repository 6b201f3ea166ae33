# SPDX-License-Identifier: Apache-2.0
"""P6: a built CPU model runner becomes an instance of a plugin subclass.

Upstream (vLLM 0.32): `vllm/v1/worker/cpu_model_runner.py:CPUModelRunner` (the instance
`CPUWorker.init_device` built; its `__class__`).
Reason: the remote-attention runner (no local KV, recovery) and its nano-batched composition are
chosen after the worker has read the attention servers' settings, once vLLM built its runner.
Delta: `swap_runner_class(runner, cls)` sets `runner.__class__ = cls`, only for a subclass of the
runner's class that adds no instance layout (`__slots__`), so every attribute vLLM set stays valid.
No-op unless remote attention (or nano-batching with it) is configured.
Removal plan: when `CPUWorker` grows `_make_model_runner`, build the right class there instead.
"""

from __future__ import annotations

from typing import Any

from vllm_disagg.patches.compat import mark_skipped, version_ok

NAME = "runner_class_swap"
UPSTREAM = "vllm/v1/worker/cpu_model_runner.py:CPUModelRunner"


def apply(hooks=None) -> bool:
    if not version_ok(NAME):
        return False
    import vllm.v1.worker.cpu_model_runner as cpu_model_runner

    if not hasattr(cpu_model_runner, "CPUModelRunner"):
        mark_skipped(NAME, "vllm.v1.worker.cpu_model_runner has no CPUModelRunner")
        return False
    return True


def swap_runner_class(runner: Any, runner_cls: type) -> None:
    """Make `runner` a `runner_cls` in place (call `require` first)."""
    if not issubclass(runner_cls, type(runner)):
        raise TypeError(f"{runner_cls.__name__} is not a subclass of {type(runner).__name__}")
    if "__slots__" in vars(runner_cls):
        raise TypeError(f"{runner_cls.__name__} defines __slots__; its instances have another layout")
    # ### PATCH START
    runner.__class__ = runner_cls
    # ### PATCH END
