# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of the router, in their own registry (one per router, so tests can run several).

Names follow `vllm:disagg_router_<what>_<unit>`. Queue depth is per pool and per instance, in
requests and in pending tokens (the JSQ measure).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

__all__ = ["RouterMetrics", "CONTENT_TYPE_LATEST"]


class RouterMetrics:
    """All router series; `render()` is the body of GET /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "vllm:disagg_router_requests", "Client requests by endpoint, route and outcome.",
            ["endpoint", "route", "outcome"], registry=r,
        )
        self.whole_requests = Counter(
            "vllm:disagg_router_whole_requests", "Requests one instance served whole (no KV push), by that "
            "instance's home pool: decode (the overflow, a pair that cannot push), prefill (the mixed pool).",
            ["pool"], registry=r,
        )
        self.fallbacks = Counter(
            "vllm:disagg_router_fallbacks", "Requests not served by the P/D push path, by reason.",
            ["reason"], registry=r,
        )
        self.prefill_failures = Counter(
            "vllm:disagg_router_prefill_failures", "P requests that failed (D recomputes the prompt).",
            ["instance"], registry=r,
        )
        self.queue_requests = Gauge(
            "vllm:disagg_router_queue_requests", "In-flight requests per pool.", ["pool"], registry=r,
        )
        self.queue_tokens = Gauge(
            "vllm:disagg_router_queue_tokens", "Pending tokens per pool (JSQ measure).", ["pool"], registry=r,
        )
        self.instance_pending_tokens = Gauge(
            "vllm:disagg_router_instance_pending_tokens", "Pending tokens per instance.",
            ["pool", "instance"], registry=r,
        )
        self.instance_prompt_queue_s = Gauge(
            "vllm:disagg_router_instance_prompt_queue_seconds", "Pending prompt tokens over the instance's measured "
            "prompt rate (0 until measured): the mixed pool's trigger.", ["pool", "instance"], registry=r,
        )
        self.instance_healthy = Gauge(
            "vllm:disagg_router_instance_healthy", "1 if the instance passes health checks.",
            ["pool", "instance"], registry=r,
        )
        self.instance_rejoins = Counter(
            "vllm:disagg_router_instance_rejoins", "Instances back in routing after they had left it (a restart, "
            "a recovered hang or network partition).", ["pool", "instance"], registry=r,
        )
        self.latency = Histogram(
            "vllm:disagg_router_request_latency_seconds", "End-to-end latency seen by the router.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "vllm:disagg_router_time_to_first_byte_seconds", "Time to the first response byte from D.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prefill_latency = Histogram(
            "vllm:disagg_router_prefill_latency_seconds", "Duration of the P request (prefill + push).",
            buckets=_LATENCY_BUCKETS, registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
