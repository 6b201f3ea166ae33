# SPDX-License-Identifier: Apache-2.0
"""Engine wiring: a DisaggConfig becomes vLLM's own engine arguments.

`wire_engine_args` is what patch P3 (`patches/engine_config_wiring.py`) runs before vLLM builds
its config, for `LLM(additional_config={"disagg": ...})` and `vllm serve --plugin disagg` alike:
it derives `--kv-transfer-config`, `--worker-cls` and the executor, but only where the user left
vLLM's defaults in place. The classes are named by qualname: vLLM imports them in its workers.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from vllm_disagg.config import DisaggConfig, DisaggConfigError, parse_disagg_config
from vllm_disagg.nanoflow.plan import apply_discrete_batching

KV_CONNECTOR = "DisaggConnector"
KV_CONNECTOR_MODULE = "vllm_disagg.kv.connector"
NANOFLOW_CPU_WORKER = "vllm_disagg.nanoflow.worker.NanoFlowCPUWorker"
NANOFLOW_GPU_WORKER = "vllm_disagg.nanoflow.gpu_worker.NanoFlowGPUWorker"
NANOFLOW_REMOTE_ATTN_WORKER = "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"
REMOTE_ATTN_WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"


def _require_module(qualname: str, feature: str) -> None:
    module = qualname.rsplit(".", 1)[0] if not qualname.endswith(".connector") else qualname
    if importlib.util.find_spec(module) is None:
        raise DisaggConfigError(f"{feature} is not available in this build of vllm-disagg ({module} missing)")


def kv_transfer_config_for(cfg: DisaggConfig) -> dict | None:
    """The --kv-transfer-config a prefill or decode instance needs."""
    if cfg.role not in ("prefill", "decode"):
        return None
    _require_module(KV_CONNECTOR_MODULE, f"--disagg-role {cfg.role}")
    producer = cfg.role == "prefill"
    return {
        "kv_connector": KV_CONNECTOR,
        "kv_connector_module_path": KV_CONNECTOR_MODULE,
        "kv_role": "kv_producer" if producer else "kv_consumer",
        "kv_load_failure_policy": "recompute",
    }


def reuse_connector_config() -> dict:
    """The --kv-transfer-config of a Lamina model worker without a prefill pool: the consumer half
    only registers and restores retained blocks (a failed restore is recomputed)."""
    _require_module(KV_CONNECTOR_MODULE, "remote attention restart reuse")
    return {"kv_connector": KV_CONNECTOR, "kv_connector_module_path": KV_CONNECTOR_MODULE,
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # planning-only installs have no vLLM
        return True
    return current_platform.is_cpu()


def worker_cls_for(cfg: DisaggConfig) -> str | None:
    """One worker class per feature combination; nano-batching composes with remote attention."""
    if cfg.remote_attention is not None and cfg.nanoflow is not None:
        worker, feature = NANOFLOW_REMOTE_ATTN_WORKER, "nano-batching with remote attention"
    elif cfg.remote_attention is not None:
        worker, feature = REMOTE_ATTN_WORKER, "remote attention"
    elif cfg.nanoflow is not None:
        worker = NANOFLOW_CPU_WORKER if _on_cpu() else NANOFLOW_GPU_WORKER
        feature = "nano-batching"
    else:
        return None
    _require_module(worker, feature)
    return worker


def check_wiring(cfg: DisaggConfig) -> None:
    """Fail early (one line, at parse time) if the config needs a part this build lacks."""
    if cfg.role == "attention":
        raise DisaggConfigError(
            "--disagg-role attention runs no vLLM engine; start it with `vllm-disagg attn-server`"
        )
    kv_transfer_config_for(cfg)
    worker_cls_for(cfg)


def wire_engine_args(engine_args: Any) -> DisaggConfig | None:
    """Fill vLLM engine args from additional_config["disagg"], leaving explicit user choices alone."""
    raw = (getattr(engine_args, "additional_config", None) or {}).get("disagg")
    if raw is None:
        return None
    cfg = parse_disagg_config(raw)
    check_wiring(cfg)
    kv = kv_transfer_config_for(cfg)
    if kv is not None and engine_args.kv_transfer_config is None:
        from vllm.config import KVTransferConfig

        engine_args.kv_transfer_config = KVTransferConfig(**kv)
    worker = worker_cls_for(cfg)
    if worker is not None and engine_args.worker_cls == "auto":
        engine_args.worker_cls = worker
    remote_attention = cfg.remote_attention
    if remote_attention is not None and engine_args.disable_hybrid_kv_cache_manager is None:
        # one KV cache group on a model worker: its runner allocates windows in full (attention/worker.py:
        # a recovery recomputes whole sequences, request-wise placement keys on a request's first block),
        # and the connector half (restart reuse, P/D pushes onto the servers) keeps one block table
        engine_args.disable_hybrid_kv_cache_manager = True
    apply_discrete_batching(engine_args, cfg)
    return cfg
