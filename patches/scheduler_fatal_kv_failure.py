# SPDX-License-Identifier: Apache-2.0
"""P4: a KV load that failed for a configuration error fails its request, even under "recompute".

Upstream (vLLM 0.32): `vllm/v1/core/sched/scheduler.py:Scheduler.update_from_output`.
Reason: `kv_load_failure_policy` is per instance. A decode instance needs "recompute" so a dead or
stalled prefill instance falls back to local prefill, but a handshake mismatch (dtype, block size,
...) must fail the request fast with the field named (issue 3), never silently recompute.
Delta: before the original runs, requests in `failed_recving` for which the connector's
`is_fatal_load_failure(req_id)` is true are finished with FINISHED_ERROR, and an output with that
finish reason is emitted for them.
No-op unless the engine's connector defines `is_fatal_load_failure` (only `DisaggConnector` does).
Removal plan: when vLLM's KVConnectorOutput carries a per-request fatal load failure.
"""

from __future__ import annotations

from vllm_disagg.patches.compat import install, version_ok

NAME = "scheduler_fatal_kv_failure"
UPSTREAM = "vllm/v1/core/sched/scheduler.py:Scheduler.update_from_output"


def apply(hooks=None) -> bool:
    if not version_ok(NAME):
        return False
    from vllm.v1.core.sched.scheduler import Scheduler

    install(Scheduler, "update_from_output", _update_from_output)
    return True


def fatal_request_ids(scheduler, kv_output) -> set[str]:
    """Requests waiting for remote KV whose load failed for a reason recompute cannot fix."""
    from vllm.v1.request import RequestStatus

    is_fatal = getattr(getattr(scheduler, "connector", None), "is_fatal_load_failure", None)
    if kv_output is None or not kv_output.failed_recving or is_fatal is None:
        return set()
    return {
        r for r in kv_output.failed_recving
        if r in scheduler.requests and is_fatal(r)
        and scheduler.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    }


def _update_from_output(self, scheduler_output, model_runner_output):
    # ### PATCH START
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    fatal = fatal_request_ids(self, model_runner_output.kv_connector_output)
    # Finish first: the blocks are then freed by the finished_recving that comes with the failure.
    errored = self.finish_requests(fatal, RequestStatus.FINISHED_ERROR) if fatal else []
    # ### PATCH END
    outputs = type(self)._vllm_disagg_original_update_from_output(self, scheduler_output, model_runner_output)
    # ### PATCH START
    for req in errored:
        eco = outputs.setdefault(req.client_index, EngineCoreOutputs())
        eco.outputs = [*eco.outputs, EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                                      finish_reason=req.get_finished_reason())]
    # ### PATCH END
    return outputs
