# SPDX-License-Identifier: Apache-2.0
"""Hardware and model catalogs: the papers' numbers as data, extendable by users.

The built-in catalogs live in `data/*.json`. Users add or override entries
with their own JSON files of the same shape, passed with `--catalog FILE`
or listed (os.pathsep-separated) in $VLLM_DISAGG_PLANNER_CATALOG. Any HF
`config.json` can stand in for a catalog model (`ModelSpec.from_hf_config`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_disagg import envs
from vllm_disagg.models import hf_text_config

CATALOG_ENV = envs.VLLM_DISAGG_PLANNER_CATALOG
_DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (LLaMA family naming)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    num_params: float = 0.0
    """Nominal parameter count (P_Model). 0 = computed from the shape."""
    dtype_bytes: int = 2
    weight_gb: float | None = None
    """Weight size in GB if a paper prints it (Lamina Table 3)."""
    active_params: float | None = None
    num_experts: int = 1
    num_experts_per_tok: int = 1
    head_dim: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if not self.num_params:
            object.__setattr__(self, "num_params", float(self.shape_params()))

    @property
    def r_gqa(self) -> float:
        """Query heads per KV head (NanoFlow R_GQA, Lamina G)."""
        return self.num_heads / self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_dim(self) -> int:
        """Width of K (or V) per token per layer."""
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token over all layers: 2·L·(d/G)·e (Lamina §2.2.2)."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        if self.weight_gb is not None:
            return self.weight_gb * 1e9
        return self.num_params * self.dtype_bytes

    @property
    def compute_params(self) -> float:
        """Parameters touched per token (active experts for MoE)."""
        return self.active_params or self.num_params

    def shape_params(self) -> int:
        """Parameter count implied by the shape (embeddings + layers + head)."""
        d, i_sz = self.hidden_size, self.intermediate_size
        attn = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d
        mlp = 3 * d * i_sz * self.num_experts
        embed = (1 if self.tie_word_embeddings else 2) * self.vocab_size * d
        return self.num_layers * (attn + mlp + 2 * d) + embed + d  # + final norm

    @classmethod
    def from_hf(cls, hf_config: Any, dtype_bytes: int) -> ModelSpec:
        """Build a spec from a loaded HF config object (a running engine's `model_config.hf_config`)."""
        heads = hf_config.num_attention_heads
        return cls(
            name=str(getattr(hf_config, "_name_or_path", "") or "model"),
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            intermediate_size=getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size),
            vocab_size=getattr(hf_config, "vocab_size", 32000),
            dtype_bytes=dtype_bytes,
            head_dim=getattr(hf_config, "head_dim", None),
        )

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Build a spec from a HF `config.json` (any family: `models.hf_text_config` maps its own names)."""
        cfg = hf_text_config(path)
        heads = cfg["num_attention_heads"]
        dtype = str(cfg.get("torch_dtype", "bfloat16"))
        return cls(
            name=name or cfg.get("_name_or_path") or Path(path).parent.name or "hf-model",
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            intermediate_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
            vocab_size=cfg.get("vocab_size", 32000),
            dtype_bytes=4 if "32" in dtype else 2,
            num_experts=cfg.get("num_local_experts", 1),
            num_experts_per_tok=cfg.get("num_experts_per_tok", 1),
            head_dim=cfg.get("head_dim"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator, or one machine of `num_devices` accelerators.

    For machines the figures are per machine: compute and memory summed."""

    name: str
    fp16_tflops: float
    mem_bw_gbs: float
    mem_gb: float
    link_gbs: float = 0.0
    """Intra-node interconnect GB/s as printed (NanoFlow Table 1)."""
    nic_gbps: float = 0.0
    power_w: float = 0.0
    price_per_hour: float | None = None
    num_devices: int = 1
    kv_layerwise_overhead_ms: float = 0.0
    """Non-overlapped tail of layer-wise KV transfer (Splitwise §VI-A)."""
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def link_oneway_gbs(self) -> float:
        """One-way bandwidth; NanoFlow footnote 5 uses it for T_net."""
        return self.link_gbs / 2

    @property
    def nic_gbs(self) -> float:
        return self.nic_gbps / 8


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read catalog {path}: {exc}") from exc


def _catalog(extra: tuple[str, ...] = ()) -> dict:
    """Built-in data, then $VLLM_DISAGG_PLANNER_CATALOG files, then `extra`."""
    env = tuple(p for p in envs.planner_catalog().split(os.pathsep) if p)
    return _load_catalog(env, tuple(extra))


@lru_cache(maxsize=8)
def _load_catalog(env: tuple[str, ...], extra: tuple[str, ...]) -> dict:
    out = {"devices": {}, "machines": {}, "models": {}}
    user = [Path(p) for p in (*env, *extra) if p]
    for path in [_DATA / "hardware.json", _DATA / "models.json", *user]:
        data = _load_json(path)
        for key in out:
            out[key].update(data.get(key, {}))
    return out


def _aliases(models: dict) -> dict[str, str]:
    table = {}
    for name, entry in models.items():
        table[name] = name
        for alias in entry.get("aliases", []):
            table[alias] = name
    return table


def get_model(name: str, extra_catalogs: tuple[str, ...] = ()) -> ModelSpec:
    """Catalog model by name/alias, or a path to a HF config.json."""
    if name.endswith(".json") or Path(name).is_dir():
        path = Path(name) / "config.json" if Path(name).is_dir() else Path(name)
        return ModelSpec.from_hf_config(path)
    models = _catalog(tuple(extra_catalogs))["models"]
    key = _aliases(models).get(name.lower())
    if key is None:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(models))} "
                       f"(or pass --model-config path/to/config.json)")
    entry = {k: v for k, v in models[key].items() if k not in ("aliases", "source")}
    return ModelSpec(name=key, **entry)


def get_hardware(name: str, extra_catalogs: tuple[str, ...] = ()) -> HardwareSpec:
    """A device (`h100`) or a machine (`dgx-h100`, figures summed over devices)."""
    cat = _catalog(tuple(extra_catalogs))
    key = name.lower()
    if key in cat["devices"]:
        return _spec(key, cat["devices"][key])
    if key in cat["machines"]:
        return _machine(key, cat["machines"][key], cat["devices"])
    known = sorted([*cat["devices"], *cat["machines"]])
    raise KeyError(f"unknown hardware {name!r}; known: {', '.join(known)}")


_FIELDS = {"fp16_tflops", "mem_bw_gbs", "mem_gb", "link_gbs", "nic_gbps", "power_w",
           "price_per_hour", "num_devices", "kv_layerwise_overhead_ms", "source"}


def _spec(name: str, entry: dict) -> HardwareSpec:
    known = {k: v for k, v in entry.items() if k in _FIELDS}
    extra = {k: v for k, v in entry.items() if k not in _FIELDS}
    return HardwareSpec(name=name, extra=extra, **known)


def _machine(name: str, entry: dict, devices: dict) -> HardwareSpec:
    dev = _spec(entry["device"], devices[entry["device"]])
    n = int(entry.get("num_devices", 1))
    base = replace(dev, name=name, fp16_tflops=dev.fp16_tflops * n,
                   mem_bw_gbs=dev.mem_bw_gbs * n, mem_gb=dev.mem_gb * n,
                   power_w=dev.power_w * n,
                   price_per_hour=None if dev.price_per_hour is None else dev.price_per_hour * n,
                   num_devices=n, source=entry.get("source", ""),
                   extra={"device": entry["device"], "perf_as": entry.get("perf_as", name)})
    per_machine = {k: v for k, v in entry.items()
                   if k in _FIELDS and k not in ("num_devices", "source")}
    if "mem_bw_gbs" in per_machine:  # catalog gives it per device
        per_machine["mem_bw_gbs"] = per_machine["mem_bw_gbs"] * n
    return replace(base, **per_machine)


def list_catalog(extra_catalogs: tuple[str, ...] = ()) -> dict[str, list[str]]:
    cat = _catalog(tuple(extra_catalogs))
    return {k: sorted(v) for k, v in cat.items()}
