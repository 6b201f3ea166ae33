# SPDX-License-Identifier: Apache-2.0
"""Engine progress of one vLLM instance (the stuck-step watchdog), exported on `GET /live`.

vLLM's `/health` only sees an engine that died: a SIGSTOPped EngineCore or one stuck inside a step
passes it. Here EngineCore says "a step started" on every schedule (`StepBeacon.beat`, called by
DisaggConnector's scheduler half) and the model says "a layer finished" while a step runs
(`LayerBeacon`, from DisaggConnector's `save_kv_layer`, at most 5 a second), with datagrams to an
abstract unix socket (`beacon.py`). The API server (`vllm serve --middleware
vllm_disagg.liveness.LiveMiddleware`, `middleware.py`) answers `GET /live` with how long the instance
has had work (generate requests in flight, or a scheduled step) without progress (a step, a layer, or
a response chunk), the wait it expects for the next sign of progress, and `recovering_s` while a
Lamina model worker rebuilds what a lost attention server held (`beacon.recovering`; `state.py`). `/health` turns
503 past `VLLM_DISAGG_STALL_TIMEOUT_S` (default 10), raised for a long expected wait
(`stall_limit_for`); the router cuts an instance whose `stalled_s` passes its limit and replays its
requests (router/README.md, "Hang detection"). Imported by `kv/` (the beacons) and, through
`--middleware`, vLLM's API server (named by `launch/local.py` and the k8s manifests). Stdlib only
(base layer).
"""

from vllm_disagg.liveness.beacon import ALIVE_PERIOD_S, ENV_SOCKET, LayerBeacon, StepBeacon, socket_name
from vllm_disagg.liveness.middleware import ENV_MAX_BODY_MB, MAX_BODY_BYTES, LiveMiddleware, max_body_bytes
from vllm_disagg.liveness.state import (
    ENV_STALL_TIMEOUT,
    LONG_STEP_MARGIN,
    MIN_STEP_SAMPLES,
    LiveState,
    live_state,
    stall_limit_for,
    stall_timeout_s,
)

__all__ = ["ALIVE_PERIOD_S", "ENV_MAX_BODY_MB", "ENV_SOCKET", "ENV_STALL_TIMEOUT", "LONG_STEP_MARGIN",
           "MAX_BODY_BYTES", "MIN_STEP_SAMPLES", "LayerBeacon", "LiveMiddleware", "LiveState", "StepBeacon",
           "live_state", "max_body_bytes", "socket_name", "stall_limit_for", "stall_timeout_s"]
