# SPDX-License-Identifier: Apache-2.0
"""The metric names that deploy/monitoring's dashboard and alert rules use, and the names each process
actually registers (in-process registries, or a /metrics scrape), for the tests that compare them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
_NAME = re.compile(r"\b(vllm:[a-z_:]+|process_[a-z_]+)")
_SUFFIX = re.compile(r"_(total|bucket|sum|count|created)$")


def family(name: str) -> str:
    """`vllm:x_total` / `_bucket` / `_sum` / `_count` -> `vllm:x` (the registry's family name)."""
    return _SUFFIX.sub("", name)


def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def rule_groups() -> tuple[list, list]:
    """(plain Prometheus rule groups, the PrometheusRule's spec.groups)."""
    plain = yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())
    crd = yaml.safe_load((MONITORING / "prometheus-rule.yaml").read_text())
    return plain["groups"], crd["spec"]["groups"]


def expressions() -> list[str]:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dashboard()["templating"]["list"] if v.get("type") == "query"]
    plain, _ = rule_groups()
    exprs += [r["expr"] for g in plain for r in g["rules"]]
    return exprs


def used_families() -> set[str]:
    return {family(m) for e in expressions() for m in _NAME.findall(e)}


def scraped_families(text: str) -> set[str]:
    """Families of a Prometheus text exposition, from HELP/TYPE lines too (labelled metrics that have
    no series yet show only those)."""
    out = set()
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            out.add(family(line.split()[2]))
        elif line and not line.startswith("#"):
            out.add(family(re.split(r"[{ ]", line, maxsplit=1)[0]))
    return out


def plugin_families() -> set[str]:
    """What the router and the attention servers register (their own registries, no engine)."""
    from prometheus_client import CollectorRegistry

    from vllm_disagg.attention.kv_ingest import KVIngest
    from vllm_disagg.attention.server_http import ServerMetrics
    from vllm_disagg.router.config import RouterConfig
    from vllm_disagg.router.server import Router

    router = Router(RouterConfig(mixed_urls=["http://127.0.0.1:9"]))
    names = {m.name for m in router.metrics.registry.collect()}
    names |= {m.name for m in ServerMetrics().registry.collect()}
    registry = CollectorRegistry()
    KVIngest("tcp", "unused", registry=registry)  # registers its counters; nothing listens until attach()
    return names | {m.name for m in registry.collect()}
