# SPDX-License-Identifier: Apache-2.0
"""serve_bench's `vllm_nixl_inline` only (serve_deploy.py puts this folder on PYTHONPATH for that
deployment's processes): NIXL agents start without their UCX progress thread.

Why: nixl 1.5's Python API hard-codes the progress thread's poll delay to 0 (`pthrDelay = 0` in
nixl_agent.__init__), so the thread calls poll(timeout=0) in a loop and burns a core per engine
while nothing moves (benchmarks/idle_cpu.py: 1.99 of 2 cores), and vLLM 0.32 passes no setting for
it. Without the thread, UCX progresses inside NIXL's own calls, which vLLM's NIXL worker makes every
engine step (transfer state, notifications). This is not what vLLM runs by default: it is NIXL
without the spin, reported as a secondary baseline beside `vllm_nixl`, never instead of it.
"""

import functools
import sys

try:
    import nixl._api as _api
except ImportError:  # no NIXL here: the deployment fails at its connector, with NIXL's own message
    _api = None

if _api is not None:
    _original_init = _api.nixl_agent_config.__init__

    @functools.wraps(_original_init)
    def _init_without_progress_thread(self, *args, **kwargs):
        kwargs["enable_prog_thread"] = False
        _original_init(self, *args, **kwargs)

    _api.nixl_agent_config.__init__ = _init_without_progress_thread
    print("vllm_nixl_inline: NIXL agents start without a UCX progress thread", file=sys.stderr)
