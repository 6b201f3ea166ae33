# SPDX-License-Identifier: Apache-2.0
"""The plugin's one typed configuration, `additional_config["disagg"]`.

Every entry point (`vllm serve --plugin disagg --disagg-*`, `LLM(additional_config=...)`,
`vllm-disagg up`) builds a `DisaggConfig`; nothing else reads raw dicts. Unknown keys and bad
values fail with a message that names the key (or the CLI flag) and the fix.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "attention", "mixed"]
TransportKind = Literal["tcp", "shm", "nixl", "rdma", "mscclpp"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


DEPRECATED_KEYS = {"nanoflow": {"nano_batches": "num_nano_batches"}}
"""section -> {old key: new key}: renamed settings, still accepted (with a warning, once)."""
_warned: set[str] = set()


def rename_deprecated(data: Any, renamed: dict[str, str], section: str) -> Any:
    """Accept each old key of `renamed` under its new name, warning once per process."""
    if not isinstance(data, dict) or not renamed.keys() & data.keys():
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"give {new!r} only ({old!r} is its deprecated name)")
        if f"{section}.{old}" not in _warned:
            _warned.add(f"{section}.{old}")
            logger.warning('vllm-disagg: additional_config["disagg"]["%s"]["%s"] is deprecated; use "%s"',
                           section, old, new)
        data[new] = data.pop(old)
    return data


def check_host_port(value: str) -> str:
    """`value` when it is HOST:PORT with a port in 1..65535, else a ValueError naming it."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return value


class KVTransferSection(_Section):
    """Splitwise P/D: how KV moves from prefill to decode."""

    transport: TransportKind = "tcp"
    """Backend of `vllm_disagg.transport` used for the KV push."""
    kv_port: int = Field(0, ge=0, lt=65536)
    """Port of this instance's KV side channel; 0 picks a free port."""
    layerwise_threshold_tokens: int = Field(256, ge=0)
    """Prompts with at least this many tokens are pushed layer by layer while prefill runs;
    shorter ones go in one serialized send at the end, as Splitwise does."""
    push_timeout_s: float = Field(30.0, gt=0)
    """A push that has not completed after this long is abandoned and D recomputes the prompt."""
    num_streams: int = Field(2, ge=1, le=64)
    """Parallel connections per peer for the tcp backend."""
    advertise_address: str | None = None
    """HOST:PORT the prefill side connects to for this decode instance's KV receiver, where that
    differs from where it listens (a NAT, a Kubernetes Service, a proxy); tensor-parallel rank r
    advertises PORT + r. Unset: the listening address."""
    verify_checksums: bool = False
    """Decode side: check every push end to end (a CRC32 per layer from P, transport/checksum.py) before its
    request runs, and recompute on a difference. Costs a pass over the KV on each side."""
    recompute_slow_pushes: bool = True
    """Decode side: cancel a push still landing longer after its prefill ended than the prefill took,
    and recompute the prompt (a slow link; kv/push_status.py). Off: such a push waits up to push_timeout_s."""

    @field_validator("advertise_address")
    @classmethod
    def _advertise_is_host_port(cls, v: str | None) -> str | None:
        return None if v is None else check_host_port(v)


class RemoteAttentionSection(_Section):
    """Lamina: decode attention on separate attention workers."""

    servers: list[str] = Field(default_factory=list)
    """HOST:PORT of each attention worker, in shard order."""
    partition: Literal["auto", "head", "request"] = "auto"
    """Head-wise (Lamina's split) or request-wise split of the KV across servers; "auto" is head-wise
    when the number of servers divides the model's KV heads, else request-wise
    (`attention.partition.resolve_partition`, at model load)."""
    send_q_early: bool | Literal["auto"] = Field("auto", validate_default=True)
    """Send Q before K/V and merge the partial softmax exactly (paper section 4.2.2). "auto" is
    resolved here, at parse time: on only where the attention kernel returns the LSE itself (GPU
    FlashAttention), off on vLLM's CPU kernel, where the LSE is recomputed in torch (2.4x slower)."""
    pipeline: int = Field(1, validate_default=True)
    """Batches in flight: 1, or 2 (ping-pong on the nano-batch executor). Only these have a runtime."""
    transport: TransportKind = "shm"
    """Backend of `vllm_disagg.transport` for the per-layer exchange."""
    timeout_s: float = Field(30.0, gt=0)
    """Longest wait for one attention server's answer; past it the server counts as lost and its
    requests are rebuilt by recompute on the servers that remain."""
    replacement_wait_s: float = Field(5.0, ge=0)
    """After a server loss, how long to wait for every configured server to answer /health (a
    replacement started at the lost address) before continuing on the ones that do."""
    spin_us: float | None = Field(None, ge=0)
    """shm: busy-poll this long for each reply before sleeping (None: the transport's default, 0 on
    <= 2 CPUs). Worth tens of microseconds per layer when the model worker has a core of its own."""

    @field_validator("servers")
    @classmethod
    def _servers_are_host_port(cls, v: list[str]) -> list[str]:
        return [check_host_port(s) for s in v]

    @field_validator("send_q_early")
    @classmethod
    def _resolve_send_q_early(cls, v: bool | str) -> bool:
        return kernel_returns_lse() if v == "auto" else bool(v)

    @field_validator("pipeline")
    @classmethod
    def _pipeline_has_a_runtime(cls, v: int) -> int:
        if v not in PIPELINE_DEPTHS:
            raise ValueError(
                f"{v} has no runtime: use 1 (one batch in flight) or 2 (ping-pong on the nano-batch executor); "
                "n>2 needs batch-context migration across model replicas, which is not built"
            )
        return v


PIPELINE_DEPTHS = (1, 2)
"""Pipeline depths with a runtime (`remote_attention.pipeline`)."""


def resolve_partition(partition: str, num_servers: int, num_kv_heads: int) -> str:
    """The partition `"auto"` stands for: head-wise (Lamina's split, every server sees every token)
    when the servers divide the KV heads evenly, else request-wise."""
    if partition != "auto":
        return partition
    return "head" if num_servers > 0 and num_kv_heads % num_servers == 0 else "request"


def kernel_returns_lse() -> bool:
    """Whether this platform's attention kernel returns the softmax LSE itself: FlashAttention on a
    CUDA-alike GPU does; vLLM's CPU kernel does not (send-Q-early then recomputes it in torch)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # planning-only installs: no kernel at all
        return False
    return bool(current_platform.is_cuda_alike())


class NanoFlowSection(_Section):
    """NanoFlow: nano-batch execution inside one instance."""

    num_nano_batches: int | Literal["auto"] = 2
    """Number of nano-batches per step (was `nano_batches`), or "auto": the tuned plan's count on the steps
    where it predicts a gain, and the plain (un-split) forward everywhere else (`nanoflow/auto.py`)."""
    plan: str | None = None
    """Path of a plan JSON written by `vllm-disagg tune`."""

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        return rename_deprecated(data, DEPRECATED_KEYS["nanoflow"], "nanoflow")

    @field_validator("num_nano_batches")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 1 <= v <= 64:
            raise ValueError(f"expected 1..64 or 'auto', got {v}")
        return v

    @property
    def nano_batches(self) -> int | str:
        """Deprecated name of `num_nano_batches`."""
        return self.num_nano_batches


class DisaggConfig(_Section):
    """All of the plugin's settings. An instance is inert unless `enabled`."""

    role: Role = "mixed"
    """What this vLLM instance does in the cluster."""
    peers: list[str] = Field(default_factory=list)
    """HOST:PORT of peer instances' KV side channels (static membership)."""
    auth_token: str | None = None
    """Shared secret that every transport peer must present; default: $VLLM_DISAGG_AUTH_TOKEN."""
    kv: KVTransferSection | None = None
    """Set for prefill/decode roles."""
    remote_attention: RemoteAttentionSection | None = None
    """Set to offload decode attention."""
    nanoflow: NanoFlowSection | None = None
    """Set to enable nano-batching."""

    @field_validator("peers")
    @classmethod
    def _peers_are_host_port(cls, v: list[str]) -> list[str]:
        return [check_host_port(p) for p in v]

    @property
    def enabled(self) -> bool:
        return bool(self.kv or self.remote_attention or self.nanoflow or self.role != "mixed")


class DisaggConfigError(ValueError):
    """A bad plugin setting, with the offending key (or flag) in the message."""


def format_validation_error(err: ValidationError, names: dict[str, str] | None = None) -> str:
    """One line per problem, naming the CLI flag when we know it (`names`: dotted key -> flag)."""
    names = names or {}
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"] if not isinstance(p, int))
        where = names.get(key) or f'additional_config["disagg"].{key}'
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown setting; known keys here: {', '.join(_known_keys(key))}"
        if e["type"] != "value_error":  # our own validators already quote the value
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def _known_keys(dotted: str) -> list[str]:
    model: type[BaseModel] = DisaggConfig
    for part in dotted.split(".")[:-1]:
        ann = model.model_fields.get(part)
        inner = getattr(ann, "annotation", None)
        for cand in getattr(inner, "__args__", (inner,)):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                model = cand
    return sorted(model.model_fields)


def parse_disagg_config(raw: Any, names: dict[str, str] | None = None) -> DisaggConfig:
    """Validate `additional_config["disagg"]` (a dict or a DisaggConfig)."""
    if isinstance(raw, DisaggConfig):
        return raw
    if not isinstance(raw, dict):
        raise DisaggConfigError(f'additional_config["disagg"] must be a JSON object, got {type(raw).__name__}')
    names = dict(names or {})
    for section, renamed in DEPRECATED_KEYS.items():  # errors name the key as it was written
        given = raw.get(section)
        for old, new in renamed.items():
            if isinstance(given, dict) and old in given and new not in given:
                names.setdefault(f"{section}.{new}", f'additional_config["disagg"].{section}.{old}')
    try:
        return DisaggConfig.model_validate(raw)
    except ValidationError as err:
        raise DisaggConfigError(format_validation_error(err, names)) from None


def disagg_config_from_vllm(vllm_config: Any) -> DisaggConfig | None:
    """The plugin config of a running engine, or None when the plugin is not configured."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    raw = additional.get("disagg") if isinstance(additional, dict) else None
    if raw is None:
        return None
    return parse_disagg_config(raw)
