# SPDX-License-Identifier: Apache-2.0
"""P5: `CPUWorker.init_device` builds the plugin's runner class instead of `CPUModelRunner`.

Upstream (vLLM 0.32): `vllm/v1/worker/cpu_worker.py:CPUModelRunner` (the module global that
`CPUWorker.init_device` instantiates inline).
Reason: the CPU worker has no `_make_model_runner` factory (the GPU `Worker` has one), so the
nano-batch worker cannot choose its runner class any other way.
Delta: for the duration of one `init_device` call the module global names the given class
(`building_cpu_runner(cls)`), then the original is put back.
No-op unless a nano-batch worker calls `building_cpu_runner` (nanoflow configured).
Removal plan: when `CPUWorker` grows `_make_model_runner`, override that instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm_disagg.patches.compat import mark_skipped, version_ok

NAME = "cpu_worker_runner"
UPSTREAM = "vllm/v1/worker/cpu_worker.py:CPUModelRunner"


def apply(hooks=None) -> bool:
    if not version_ok(NAME):
        return False
    import vllm.v1.worker.cpu_worker as cpu_worker

    if not hasattr(cpu_worker, "CPUModelRunner"):
        mark_skipped(NAME, "vllm.v1.worker.cpu_worker has no CPUModelRunner")
        return False
    return True


@contextmanager
def building_cpu_runner(runner_cls: type) -> Iterator[None]:
    """Inside the block, `CPUWorker.init_device` builds `runner_cls` (call `require` first)."""
    import vllm.v1.worker.cpu_worker as cpu_worker

    original = cpu_worker.CPUModelRunner
    # ### PATCH START
    cpu_worker.CPUModelRunner = runner_cls
    # ### PATCH END
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original
