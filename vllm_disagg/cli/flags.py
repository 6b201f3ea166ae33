# SPDX-License-Identifier: Apache-2.0
"""The `--plugin disagg` and `--disagg-*` flags (patch P2 adds them to `vllm serve`).

`merge_flags_into_namespace` folds them into `additional_config["disagg"]`, validating with
`DisaggConfig` and naming the flag on error; from there the CLI and `LLM(additional_config=...)`
share one path, `vllm_disagg.wiring.wire_engine_args` (patch P3).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from vllm_disagg.config import DisaggConfig, DisaggConfigError, parse_disagg_config
from vllm_disagg.wiring import (  # noqa: F401 - re-exported: the wiring lived here before
    KV_CONNECTOR,
    KV_CONNECTOR_MODULE,
    NANOFLOW_CPU_WORKER,
    NANOFLOW_GPU_WORKER,
    NANOFLOW_REMOTE_ATTN_WORKER,
    REMOTE_ATTN_WORKER,
    check_wiring,
    kv_transfer_config_for,
    reuse_connector_config,
    wire_engine_args,
    worker_cls_for,
)

PLUGIN_NAME = "disagg"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Flag:
    flag: str
    key: str
    """Dotted path inside additional_config["disagg"]."""
    help: str
    choices: tuple[str, ...] | None = None
    kind: str = "str"
    """str | int | float | list (comma separated or repeated)."""
    deprecated: tuple[str, ...] = ()
    """Old spellings of the flag, still accepted with a warning."""


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
    Flag("--disagg-kv-advertise", "kv.advertise_address",
         "HOST:PORT the prefill side connects to for this decode instance's KV receiver (a NAT, a Service, a proxy)."),
    Flag("--disagg-kv-verify", "kv.verify_checksums",
         "Decode side: check each push's landed KV against P's checksums; recompute on a difference.", ("on", "off")),
    Flag("--disagg-recompute-slow-pushes", "kv.recompute_slow_pushes",
         "Decode side: recompute a push that lands slower than its prefill computed (a slow link).", ("on", "off")),
    Flag("--disagg-attention-servers", "remote_attention.servers",
         "HOST:PORT of each attention worker (comma separated or repeated).", kind="list"),
    Flag("--disagg-attention-partition", "remote_attention.partition",
         "How KV is split across attention workers (auto: head-wise when the servers divide the KV heads).",
         ("auto", "head", "request")),
    Flag("--disagg-pipeline", "remote_attention.pipeline", "Batches in flight with remote attention: 1, or 2 (ping-pong).",
         kind="int"),
    Flag("--disagg-num-nano-batches", "nanoflow.num_nano_batches", "Nano-batches per step, or 'auto' for the tuned plan.",
         deprecated=("--disagg-nano-batches",)),
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
        action = _warn_deprecated(flag, "append" if flag.kind == "list" else "store")
        group.add_argument(flag.flag, *flag.deprecated, dest=_dest(flag), action=action, default=None,
                           choices=flag.choices, help=flag.help)


def _warn_deprecated(flag: Flag, action: str):
    """argparse's store/append, warning (once) when a deprecated spelling of `flag` is used."""
    if not flag.deprecated:
        return action
    base = argparse._AppendAction if action == "append" else argparse._StoreAction

    class Deprecated(base):
        def __call__(self, parser, namespace, values, option_string=None):
            if option_string in flag.deprecated:
                logger.warning("vllm-disagg: %s is deprecated; use %s", option_string, flag.flag)
                vars(namespace).setdefault(_SPELLED, {})[flag.key] = option_string
            super().__call__(parser, namespace, values, option_string)

    return Deprecated


_SPELLED = "_disagg_deprecated_spellings"  # key -> the deprecated flag the user typed


def _spelling(args: argparse.Namespace, flag: Flag) -> str:
    """The flag as the user typed it (a deprecated spelling, or the flag)."""
    return getattr(args, _SPELLED, {}).get(flag.key, flag.flag)


def _convert(flag: Flag, value: Any, name: str) -> Any:
    if flag.kind == "list":
        return [item for v in value for item in str(v).split(",") if item]
    if flag.kind in ("int", "float"):
        try:
            return int(value) if flag.kind == "int" else float(value)
        except ValueError:
            raise DisaggConfigError(f"{name}: expected a number, got {value!r}") from None
    if flag.key == "nanoflow.num_nano_batches" and value != "auto":
        try:
            return int(value)
        except ValueError:
            raise DisaggConfigError(f"{name}: expected an integer or 'auto', got {value!r}") from None
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
            raise DisaggConfigError(f"{_spelling(args, given[0])} needs --plugin {PLUGIN_NAME}")
        return None
    raw: dict = dict(base or {})
    for flag in given:
        _set_dotted(raw, flag.key, _convert(flag, getattr(args, _dest(flag)), _spelling(args, flag)))
    return parse_disagg_config(raw, {f.key: _spelling(args, f) for f in FLAGS})


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
    (kv/lamina/reuse.py), which needs the connector's consumer half. CLI only: vLLM's connector
    agent is process-global, so an implicit connector under LLM() would leak into the next
    in-process engine; API users pass `kv_transfer_config=reuse_connector_config()`."""
    from vllm.config import KVTransferConfig

    args.kv_transfer_config = KVTransferConfig(**reuse_connector_config())
