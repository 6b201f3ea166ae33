# SPDX-License-Identifier: Apache-2.0
"""Environment switches of the plugin, with typed getters. Config stays the way to turn features on.

Every `VLLM_DISAGG_*` name the package reads is listed here, so `grep envs.py` answers "what can I
set". Modules read them through these getters (read at call time: tests set them per case). Pure
stdlib on purpose: the soft-RoCE VM (Debian python, no pydantic/torch) imports it through the rdma
backend.
"""

from __future__ import annotations

import os
from pathlib import Path

VLLM_DISAGG_CACHE = "VLLM_DISAGG_CACHE"
VLLM_DISAGG_AUTH_TOKEN = "VLLM_DISAGG_AUTH_TOKEN"
VLLM_DISAGG_NANOFLOW_AB = "VLLM_DISAGG_NANOFLOW_AB"
VLLM_DISAGG_PLANNER_CATALOG = "VLLM_DISAGG_PLANNER_CATALOG"
VLLM_DISAGG_RDMA_DEVICE = "VLLM_DISAGG_RDMA_DEVICE"
VLLM_DISAGG_RDMA_PORT = "VLLM_DISAGG_RDMA_PORT"
VLLM_DISAGG_RDMA_GID_INDEX = "VLLM_DISAGG_RDMA_GID_INDEX"
VLLM_DISAGG_RDMA_COMPLETION = "VLLM_DISAGG_RDMA_COMPLETION"
VLLM_DISAGG_SEQNO_LIB = "VLLM_DISAGG_SEQNO_LIB"
VLLM_DISAGG_MSCCLPP_CHANNEL = "VLLM_DISAGG_MSCCLPP_CHANNEL"
VLLM_DISAGG_TRACE_ATTENTION_EVERY = "VLLM_DISAGG_TRACE_ATTENTION_EVERY"

RDMA_COMPLETIONS = ("seqword", "imm")


def cache_dir() -> Path:
    """Where pulled models and plans live (default ~/.cache/vllm-disagg)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-disagg"
    return Path(os.environ.get(VLLM_DISAGG_CACHE, default))


def auth_token() -> str | None:
    return os.environ.get(VLLM_DISAGG_AUTH_TOKEN) or None


def nanoflow_ab() -> bool:
    """Diagnostic: "1" alternates nano-batched and plain forwards of eligible steps in one engine and
    reports both in `nanoflow_stats()["ab"]` (same process, same load: a paired overhead figure)."""
    return os.environ.get(VLLM_DISAGG_NANOFLOW_AB) == "1"


def planner_catalog() -> str:
    """Extra planner catalog JSON file(s), loaded after the built-in data ("" = built-in only)."""
    return os.environ.get(VLLM_DISAGG_PLANNER_CATALOG, "")


def rdma_device() -> str | None:
    """ibverbs device name for the rdma backend (None = first device listed)."""
    return os.environ.get(VLLM_DISAGG_RDMA_DEVICE) or None


def rdma_port() -> int:
    return int(os.environ.get(VLLM_DISAGG_RDMA_PORT, "1"))


def rdma_gid_index() -> int | None:
    """GID index override (None = an IPv4-mapped RoCEv2 GID, else the first non-zero one)."""
    raw = os.environ.get(VLLM_DISAGG_RDMA_GID_INDEX)
    return int(raw) if raw else None


def rdma_completion() -> str:
    """How an rdma KV sender signals a finished block-run post: `seqword` (WRITE of seq+1 polled in
    memory, default) or `imm` (last WR is RDMA_WRITE_WITH_IMM, safe under PCIe relaxed ordering)."""
    value = os.environ.get(VLLM_DISAGG_RDMA_COMPLETION, "seqword").strip().lower() or "seqword"
    if value not in RDMA_COMPLETIONS:
        raise ValueError(f"{VLLM_DISAGG_RDMA_COMPLETION}={value!r}: expected one of {RDMA_COMPLETIONS}")
    return value


def seqno_lib() -> str | None:
    """Path of `libvd_seqno.so` built by `csrc/build.sh` (None = look beside the package)."""
    return os.environ.get(VLLM_DISAGG_SEQNO_LIB) or None


def mscclpp_channel() -> str:
    """mscclpp channel kind: `port` (proxy-driven, IB/RoCE across nodes) or `memory` (NVLink/IPC)."""
    value = os.environ.get(VLLM_DISAGG_MSCCLPP_CHANNEL, "port").strip().lower() or "port"
    if value not in ("port", "memory"):
        raise ValueError(f"{VLLM_DISAGG_MSCCLPP_CHANNEL}={value!r}: expected 'port' or 'memory'")
    return value


def trace_attention_every() -> int:
    """Lamina tracing: the attention-server calls of every Nth step of a traced request become spans
    (its first step included; default 16; 0: none)."""
    return int(os.environ.get(VLLM_DISAGG_TRACE_ATTENTION_EVERY, "16"))
