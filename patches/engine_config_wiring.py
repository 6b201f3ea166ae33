# SPDX-License-Identifier: Apache-2.0
"""P3: `additional_config["disagg"]` selects the connector, worker and executor by itself.

Upstream (vLLM 0.32): `vllm/engine/arg_utils.py:EngineArgs.create_engine_config`.
Reason: `LLM(model, additional_config={"disagg": ...})` and `vllm serve --plugin disagg` must work
without the user also spelling `--kv-transfer-config` / `--worker-cls` (afd-plugin precedent).
Delta: before the original runs, validate the disagg config (clear error naming the key) and fill
`kv_transfer_config` / `worker_cls` where they are still vLLM's defaults.
No-op when `additional_config` has no "disagg" key.
Removal plan: none upstream yet; keep in step with `create_engine_config`'s signature.
"""

from __future__ import annotations

from vllm_disagg.patches.compat import install, version_ok

NAME = "engine_config_wiring"


def apply() -> bool:
    if not version_ok(NAME):
        return False
    from vllm.engine.arg_utils import EngineArgs

    install(EngineArgs, "create_engine_config", _create_engine_config)
    return True


def _create_engine_config(self, *args, **kwargs):
    # ### PATCH START
    from vllm_disagg.cli.flags import wire_engine_args

    wire_engine_args(self)
    # ### PATCH END
    return type(self)._vllm_disagg_original_create_engine_config(self, *args, **kwargs)
