# SPDX-License-Identifier: Apache-2.0
"""`vllm_disagg.kv`: Splitwise prefill -> decode layer-wise KV push as a vLLM KV connector.

Load with `kv_connector="DisaggConnector"`, `kv_connector_module_path="vllm_disagg.kv.connector"`.
Heavy classes load lazily so `import vllm_disagg.kv` stays cheap; reading path in README.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "DisaggConnector", "register"]

CONNECTOR_NAME = "DisaggConnector"
CONNECTOR_MODULE = "vllm_disagg.kv.connector"


def register() -> None:
    """Nothing to register: vLLM imports the connector through `kv_connector_module_path`.

    Kept (idempotent, inert) so the top-level plugin can call it uniformly."""


def __getattr__(name: str) -> Any:
    if name == "DisaggConnector":
        from vllm_disagg.kv.connector import DisaggConnector

        return DisaggConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
