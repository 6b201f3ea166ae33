# SPDX-License-Identifier: Apache-2.0
"""Transfer statistics of the KV push, and their Prometheus export (`vllm:disagg_kv_*`).

Workers record into `DisaggKVConnectorStats` (units normalised at record time: bytes, seconds);
vLLM ships each step's snapshot to the frontend, where `DisaggKVPromMetrics.observe` turns it into:

    vllm:disagg_kv_bytes_pushed_total            counter    bytes written to decode instances
    vllm:disagg_kv_layer_transfer_seconds        histogram  one layer's write (issue -> landed)
    vllm:disagg_kv_request_transfer_seconds      histogram  first write issued -> last write landed
    vllm:disagg_kv_exposed_transfer_seconds      histogram  part of a push after prefill ended (exposed)
    vllm:disagg_kv_fallbacks_total               counter    decode requests recomputed locally
    vllm:disagg_kv_handshake_failures_total      counter    transfers refused by the handshake
    vllm:disagg_kv_checksum_mismatches_total     counter    verified pushes whose landed KV differed
    vllm:disagg_kv_slow_push_recomputes_total    counter    pushes given up on a slow link (also fallbacks)
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["DisaggKVConnectorStats", "DisaggKVPromMetrics"]

_LIST_KEYS = ("bytes_pushed", "layer_seconds", "request_seconds", "exposed_seconds")
_COUNT_KEYS = ("num_fallbacks", "num_handshake_failures", "num_checksum_mismatches", "num_slow_push_recomputes")
_SECONDS_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@dataclass
class DisaggKVConnectorStats(KVConnectorStats):
    """Observations since the last snapshot; serialisable (plain lists and ints).

    Not thread-safe by itself: the worker records and snapshots under its own lock."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{k: [] for k in _LIST_KEYS}, **{k: 0 for k in _COUNT_KEYS}}

    def record_layer(self, nbytes: int, seconds: float) -> None:
        self.data["bytes_pushed"].append(int(nbytes))
        self.data["layer_seconds"].append(float(seconds))

    def record_request(self, seconds: float, exposed_seconds: float) -> None:
        self.data["request_seconds"].append(float(seconds))
        self.data["exposed_seconds"].append(max(0.0, float(exposed_seconds)))

    def record_fallback(self) -> None:
        self.data["num_fallbacks"] += 1

    def record_handshake_failure(self) -> None:
        self.data["num_handshake_failures"] += 1

    def record_checksum_mismatch(self) -> None:
        self.data["num_checksum_mismatches"] += 1

    def record_slow_push_recompute(self) -> None:
        self.data["num_slow_push_recomputes"] += 1

    def clone_and_reset(self) -> DisaggKVConnectorStats:
        old = DisaggKVConnectorStats(data=copy.deepcopy(self.data))
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _LIST_KEYS) and not any(self.data[k] for k in _COUNT_KEYS)

    def aggregate(self, other: KVConnectorStats) -> DisaggKVConnectorStats:
        for k in _LIST_KEYS:
            self.data[k].extend(other.data.get(k, []))
        for k in _COUNT_KEYS:
            self.data[k] += int(other.data.get(k, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        req = self.data["request_seconds"]
        exposed = self.data["exposed_seconds"]
        total_bytes = sum(self.data["bytes_pushed"])
        busy = sum(self.data["layer_seconds"]) or 1e-12
        return {
            "Num pushes": len(req),
            "MB pushed": round(total_bytes / 2**20, 3),
            "Avg push time (ms)": round(1e3 * sum(req) / len(req), 3) if req else 0,
            "Avg exposed time (ms)": round(1e3 * sum(exposed) / len(exposed), 3) if exposed else 0,
            "Layer write throughput (MB/s)": round(total_bytes / 2**20 / busy, 1) if total_bytes else 0,
            "Num fallbacks": self.data["num_fallbacks"],
            "Num handshake failures": self.data["num_handshake_failures"],
            "Num checksum mismatches": self.data["num_checksum_mismatches"],
            "Num slow-push recomputes": self.data.get("num_slow_push_recomputes", 0),
        }

StatsSink = tuple[DisaggKVConnectorStats, AbstractContextManager]
"""The worker's stats and the lock that guards them (what PushSender/PushReceiver record into)."""


class DisaggKVPromMetrics(KVConnectorPromMetrics):
    """Registers the `vllm:disagg_kv_*` metrics once per engine and records snapshots into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.bytes_pushed = self._per_engine(self._counter_cls, "bytes_pushed", "Bytes of KV pushed to decode instances.")
        self.layer_seconds = self._histogram("layer_transfer_seconds", "Time to write one layer's KV blocks.")
        self.request_seconds = self._histogram("request_transfer_seconds", "Time from a push's first write to its last landed.")
        self.exposed_seconds = self._histogram(
            "exposed_transfer_seconds", "Part of a push that ran after prefill ended (not hidden behind compute)."
        )
        self.fallbacks = self._per_engine(self._counter_cls, "fallbacks", "Decode requests that recomputed the prompt locally.")
        self.handshake_failures = self._per_engine(
            self._counter_cls, "handshake_failures", "KV transfers refused by the compatibility handshake."
        )
        self.checksum_mismatches = self._per_engine(
            self._counter_cls, "checksum_mismatches", "Verified KV pushes whose landed blocks differed from P's."
        )
        self.slow_push_recomputes = self._per_engine(
            self._counter_cls, "slow_push_recomputes", "KV pushes given up on a slow link and recomputed."
        )

    def _per_engine(self, cls: type, what: str, doc: str, **kw: Any) -> dict[int, Any]:
        metric = cls(name=f"vllm:disagg_kv_{what}", documentation=doc, labelnames=self._labelnames, **kw)
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def _histogram(self, what: str, doc: str) -> dict[int, Any]:
        return self._per_engine(self._histogram_cls, what, doc, buckets=_SECONDS_BUCKETS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        if data.get("bytes_pushed"):
            self.bytes_pushed[engine_idx].inc(sum(data["bytes_pushed"]))
        for key, hist in (
            ("layer_seconds", self.layer_seconds),
            ("request_seconds", self.request_seconds),
            ("exposed_seconds", self.exposed_seconds),
        ):
            for value in data.get(key, ()):
                hist[engine_idx].observe(value)
        if data.get("num_fallbacks"):
            self.fallbacks[engine_idx].inc(data["num_fallbacks"])
        if data.get("num_handshake_failures"):
            self.handshake_failures[engine_idx].inc(data["num_handshake_failures"])
        if data.get("num_checksum_mismatches"):
            self.checksum_mismatches[engine_idx].inc(data["num_checksum_mismatches"])
        if data.get("num_slow_push_recomputes"):
            self.slow_push_recomputes[engine_idx].inc(data["num_slow_push_recomputes"])
