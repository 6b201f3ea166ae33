# SPDX-License-Identifier: Apache-2.0
"""P3: `additional_config["disagg"]` selects the connector, worker and executor by itself.

Upstream (vLLM 0.32): `vllm/engine/arg_utils.py:EngineArgs.create_engine_config`.
Reason: `LLM(model, additional_config={"disagg": ...})` and `vllm serve --plugin disagg` must work
without the user also spelling `--kv-transfer-config` / `--worker-cls` (afd-plugin precedent).
Delta: before the original runs, `hooks.wire_engine_args` validates the disagg config (clear error
naming the key) and fills `kv_transfer_config` / `worker_cls` where they are still vLLM's defaults.
Fail closed: on another vLLM the delta is only a refusal, so an enabled disagg config fails here
with one line instead of quietly running stock vLLM; every other config passes through untouched.
No-op when `additional_config` has no "disagg" key.
Removal plan: none upstream yet; keep in step with `create_engine_config`'s signature.
"""

from __future__ import annotations

from vllm_disagg.config import parse_disagg_config
from vllm_disagg.patches.compat import PatchNotApplied, install, mark_skipped, skip_reason, version_ok

NAME = "engine_config_wiring"
UPSTREAM = "vllm/engine/arg_utils.py:EngineArgs.create_engine_config"


def apply(hooks=None) -> bool:
    from vllm.engine.arg_utils import EngineArgs

    install(EngineArgs, "create_engine_config", _create_engine_config)  # on any version: it may refuse
    if not version_ok(NAME):
        EngineArgs._vllm_disagg_wire_engine_args = None
        return False
    if hooks is not None and hooks.wire_engine_args is not None:
        EngineArgs._vllm_disagg_wire_engine_args = staticmethod(hooks.wire_engine_args)
    if getattr(EngineArgs, "_vllm_disagg_wire_engine_args", None) is None:
        mark_skipped(NAME, "vllm_disagg.register() gave it no wiring hook")
        return False
    return True


def _create_engine_config(self, *args, **kwargs):
    # ### PATCH START
    if (getattr(self, "additional_config", None) or {}).get("disagg") is not None:
        wire = getattr(type(self), "_vllm_disagg_wire_engine_args", None)
        if wire is None:
            _refuse(self.additional_config["disagg"])
        else:
            wire(self)
    # ### PATCH END
    return type(self)._vllm_disagg_original_create_engine_config(self, *args, **kwargs)


def _refuse(raw) -> None:
    if parse_disagg_config(raw).enabled:
        raise PatchNotApplied(f'vllm-disagg: additional_config["disagg"] needs patch {NAME} ({UPSTREAM}), '
                              f"which did not apply: {skip_reason(NAME) or 'see the log'}")
