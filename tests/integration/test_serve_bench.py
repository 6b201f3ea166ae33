# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_bench.py end to end on a 6-request trace: vLLM's client against our 1P+1D and vLLM's
NixlConnector 1P+1D, each started once as a user starts it. The JSON has every goal key, the NIXL
baseline really moved the KV (bytes counted, no request recomputed on D) — as did ours — and our
rate search ran in the same start as its round, from the bracket the round measured (the search
run on its own, `--bisect-only`, seeds at the headline rate: test_serve_bisect.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
DEPLOYMENTS = ("vllm_nixl", "ours_tcp")


def test_serve_bench_runs_on_a_small_trace_both_pd_deployments_move_their_kv_and_search_their_rate(
        smollm2_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_bench import GOAL_KEYS

    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/serve_bench.py"), "--trace", "synthetic", "--num-requests", "6",
           "--rate", "1", "--rounds", "1", "--deployments", ",".join(DEPLOYMENTS), "--bisect", "ours_tcp", "--bisect-hi", "1",
           "--no-saturation", "--no-predict", "--max-model-len", "512", "--max-output-tokens", "8",
           "--model", smollm2_dir, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(GOAL_KEYS) <= printed.keys()
    assert printed["vllm_nixl_kv_bytes"] > 0 and printed["vllm_nixl_recomputes"] == 0
    assert printed["nixl_verified"] is True and printed["ours_verified"] is True
    assert printed["ttft_p50_ratio_vs_vllm_nixl"] is not None  # the goodput ratio is "unbounded" if NIXL kept none
    result = json.loads(out.read_text())
    headline = {r["deployment"]: r for r in result["runs"] if r["kind"] == "headline"}
    assert headline.keys() == set(DEPLOYMENTS)
    for run in headline.values():
        assert run["num_requests"] == 6 and run["num_failed"] == 0 and run["num_gaps"] == run["output_tokens"] - 6
        assert run["kv"]["kv_bytes"] > 0 and run["kv"]["recomputes"] == 0 and run["kv"]["decode_requests"] + run["kv"]["routed_whole_by_pool"]["prefill"] == 6
    assert {name: len(starts) for name, starts in result["starts"].items()} == dict.fromkeys(DEPLOYMENTS, 1)
    assert result["max_rates"].keys() == {"ours_tcp"}  # --bisect: the search reused ours_tcp's round start
    found = result["max_rates"]["ours_tcp"]
    assert found["seeded"] == [] and (found["max_rate"] is None or 0.25 <= found["max_rate"] <= 1.0)
    probes = [r for r in result["runs"] if r["kind"] == "bisect"]
    assert [(r["deployment"], r["rate"]) for r in probes] == [("ours_tcp", round(p["rate"], 4)) for p in found["probes"]]
    assert all(r["window_size"] <= 6 and r["kv"]["verified"] for r in probes)
    assert out.with_suffix(".png").stat().st_size > 10_000
