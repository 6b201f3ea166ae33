# SPDX-License-Identifier: Apache-2.0
"""The `--plugin disagg` and `--disagg-*` flags, and how they become vLLM's own settings.

Two steps, so the CLI and `LLM(additional_config=...)` share one path:
1. `merge_flags_into_namespace` (CLI only) folds the `--disagg-*` flags into
   `additional_config["disagg"]`, validating with `DisaggConfig` and naming the flag on error.
2. `wire_engine_args` (CLI and Python API) derives `--kv-transfer-config`, `--worker-cls` and the
   executor from that config, but only where the user left vLLM's defaults in place.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import Any

from vllm_disagg.config import DisaggConfig, DisaggConfigError, parse_disagg_config

PLUGIN_NAME = "disagg"


@dataclass(frozen=True)
class Flag:
    flag: str
    key: str
    """Dotted path inside additional_config["disagg"]."""
    help: str
    choices: tuple[str, ...] | None = None
    kind: str = "str"
    """str | int | float | list (comma separated or repeated)."""


FLAGS = [
    Flag("--disagg-role", "role", "What this instance does.", ("prefill", "decode", "attention", "mixed")),
    Flag("--disagg-peer", "peers", "HOST:PORT of a peer KV side channel (repeatable).", kind="list"),
    Flag("--disagg-auth-token", "auth_token", "Shared secret for transport peers (default $VLLM_DISAGG_AUTH_TOKEN)."),
    Flag("--disagg-transport", "kv.transport", "KV transport backend.", ("tcp", "shm", "nixl", "rdma", "mscclpp")),
    Flag("--disagg-kv-port", "kv.kv_port", "Port of this instance's KV side channel (0: any free).", kind="int"),
    Flag("--disagg-layerwise-threshold", "kv.layerwise_threshold_tokens",
         "Prompts with at least this many tokens are pushed layer by layer.", kind="int"),
    Flag("--disagg-push-timeout", "kv.push_timeout_s", "Seconds before D gives up on a push and recomputes.",
         kind="float"),
    Flag("--disagg-attention-servers", "remote_attention.servers",
         "HOST:PORT of each attention worker (comma separated or repeated).", kind="list"),
    Flag("--disagg-attention-partition", "remote_attention.partition", "How KV is split across attention workers.",
         ("head", "request")),
    Flag("--disagg-pipeline", "remote_attention.pipeline", "Batches in flight with remote attention.", kind="int"),
    Flag("--disagg-nano-batches", "nanoflow.nano_batches", "Nano-batches per step, or 'auto' for the tuned plan."),
    Flag("--disagg-nano-plan", "nanoflow.plan", "Plan JSON written by `vllm-disagg tune`."),
]
FLAG_NAMES = {f.key: f.flag for f in FLAGS}


def _dest(flag: Flag) -> str:
    return flag.flag.lstrip("-").replace("-", "_")


def add_disagg_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--plugin` and the `--disagg-*` flags; values are checked later, as a whole config."""
    group = parser.add_argument_group("vllm-disagg", "Enabled by --plugin disagg (see vllm-disagg README).")
    group.add_argument("--plugin", action="append", default=None, metavar="NAME",
                       help="Enable a serving plugin by name; 'disagg' adds disaggregated serving.")
    for flag in FLAGS:
        action = "append" if flag.kind == "list" else "store"
        group.add_argument(flag.flag, dest=_dest(flag), action=action, default=None,
                           choices=flag.choices, help=flag.help)


def _convert(flag: Flag, value: Any) -> Any:
    if flag.kind == "list":
        return [item for v in value for item in str(v).split(",") if item]
    if flag.kind in ("int", "float"):
        try:
            return int(value) if flag.kind == "int" else float(value)
        except ValueError:
            raise DisaggConfigError(f"{flag.flag}: expected a number, got {value!r}") from None
    if flag.key == "nanoflow.nano_batches" and value != "auto":
        try:
            return int(value)
        except ValueError:
            raise DisaggConfigError(f"{flag.flag}: expected an integer or 'auto', got {value!r}") from None
    return value


def _set_dotted(target: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
    target[leaf] = value


def flags_to_config(args: argparse.Namespace, base: dict | None = None) -> DisaggConfig | None:
    """The DisaggConfig the command line asks for, or None when `--plugin disagg` is absent."""
    plugins = getattr(args, "plugin", None) or []
    unknown = [p for p in plugins if p != PLUGIN_NAME]
    if unknown:
        raise DisaggConfigError(f"--plugin: unknown plugin {unknown[0]!r}; available: {PLUGIN_NAME}")
    given = [f for f in FLAGS if getattr(args, _dest(f), None) is not None]
    if not plugins:
        if given:
            raise DisaggConfigError(f"{given[0].flag} needs --plugin {PLUGIN_NAME}")
        return None
    raw: dict = dict(base or {})
    for flag in given:
        _set_dotted(raw, flag.key, _convert(flag, getattr(args, _dest(flag))))
    return parse_disagg_config(raw, FLAG_NAMES)


def merge_flags_into_namespace(args: argparse.Namespace) -> None:
    """Fold the plugin flags into `args.additional_config["disagg"]` (in place)."""
    additional = dict(getattr(args, "additional_config", None) or {})
    cfg = flags_to_config(args, additional.get("disagg"))
    if cfg is None:
        return
    check_wiring(cfg)
    additional["disagg"] = cfg.model_dump(exclude_none=True)
    args.additional_config = additional
    if cfg.remote_attention is not None and getattr(args, "kv_transfer_config", None) is None:
        _wire_restart_reuse(args)


def _wire_restart_reuse(args: argparse.Namespace) -> None:
    """A `vllm serve` model worker restores its attention servers' KV after a restart
    (attention/reuse.py), which needs the connector's consumer half. CLI only: vLLM's connector
    agent is process-global, so an implicit connector under LLM() would leak into the next
    in-process engine; API users pass `kv_transfer_config=reuse_connector_config()`."""
    from vllm.config import KVTransferConfig

    args.kv_transfer_config = KVTransferConfig(**reuse_connector_config())


# ---------------------------------------------------------------------------
# Wiring: DisaggConfig -> vLLM's native engine arguments
# ---------------------------------------------------------------------------

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
    from vllm_disagg.nanoflow.plan import apply_discrete_batching

    apply_discrete_batching(engine_args, cfg)
    return cfg
