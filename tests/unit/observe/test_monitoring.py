# SPDX-License-Identifier: Apache-2.0
"""deploy/monitoring: the Grafana dashboard and the alert rules parse, cover what an operator needs,
and name only metrics that the plugin or vLLM register (read from their registries: a labelled
series appears in a scrape only once used). A live scrape of a real 1P+1D deployment:
tests/integration/test_router_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_disagg.testing import monitoring

_VLLM_REGISTRY = r"""
import json, sys
from pathlib import Path
from vllm_disagg.testing import make_tiny_llama
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.loggers import PrometheusStatLogger
from prometheus_client import REGISTRY
model = make_tiny_llama(Path(sys.argv[1]))
kv = KVTransferConfig(kv_connector="DisaggConnector", kv_connector_module_path="vllm_disagg.kv.connector",
                      kv_role="kv_both")
PrometheusStatLogger(EngineArgs(model=str(model), max_model_len=256, kv_transfer_config=kv).create_engine_config(), [0])
print(json.dumps(sorted({m.name for m in REGISTRY.collect()})))
"""


def test_every_metric_named_is_registered_by_the_plugin_or_vllm(tmp_path):
    out = subprocess.run([sys.executable, "-c", _VLLM_REGISTRY, str(tmp_path / "m")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    vllm_names = set(json.loads(out.stdout.strip().splitlines()[-1]))  # vLLM's loggers + our connector's
    assert "vllm:disagg_kv_exposed_transfer_seconds" in vllm_names
    registered = vllm_names | monitoring.plugin_families()
    used = monitoring.used_families()
    assert len(used) > 30
    assert sorted(used - registered) == []


def test_dashboard_covers_the_operators_questions():
    dash = monitoring.dashboard()
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("pool", "queue", "ttft", "tbt", "kv push bandwidth", "exposed", "fallbacks", "replays",
                  "attention server load", "retained", "restarts"):
        assert topic in titles, topic
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["type"] == "row" or (p["targets"] and p["datasource"]["uid"] == "${datasource}")
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_plain_rules_and_prometheus_rule_are_the_same_and_cover_the_failures():
    plain, crd = monitoring.rule_groups()
    assert plain == crd
    rules = {r["alert"]: r for g in plain for r in g["rules"]}
    for name in ("VllmDisaggEmptyPool", "VllmDisaggInstanceStalled", "VllmDisaggHighFallbackRate",
                 "VllmDisaggHighReplayRate", "VllmDisaggKVBlocksNotReturning"):
        assert name in rules
    for r in rules.values():
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["expr"]
