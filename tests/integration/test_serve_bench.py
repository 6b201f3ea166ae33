# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_bench.py end to end on a 6-request trace: vLLM's client against our 1P+1D and vLLM's
NixlConnector 1P+1D, each started as a user starts it. The JSON has every goal key, and the NIXL
baseline really moved the KV (bytes counted, no request recomputed on D) — as did ours."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def test_serve_bench_runs_on_a_small_trace_and_both_pd_deployments_move_their_kv(smollm2_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_bench import GOAL_KEYS

    out = tmp_path / "serve.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/serve_bench.py"), "--trace", "synthetic", "--num-requests", "6",
           "--rate", "1", "--rounds", "1", "--deployments", "vllm_nixl,ours_tcp", "--no-bisect", "--no-saturation",
           "--no-predict", "--max-model-len", "512", "--max-output-tokens", "8", "--model", smollm2_dir,
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(GOAL_KEYS) <= printed.keys()
    assert printed["vllm_nixl_kv_bytes"] > 0 and printed["vllm_nixl_recomputes"] == 0
    assert printed["nixl_verified"] is True and printed["ours_verified"] is True
    assert printed["ttft_p50_ratio_vs_vllm_nixl"] is not None  # the goodput ratio is "unbounded" if NIXL kept none
    result = json.loads(out.read_text())
    runs = {r["deployment"]: r for r in result["runs"]}
    assert runs.keys() == {"vllm_nixl", "ours_tcp"}
    for run in runs.values():
        assert run["num_requests"] == 6 and run["num_failed"] == 0 and run["num_gaps"] == run["output_tokens"] - 6
        assert run["kv"]["kv_bytes"] > 0 and run["kv"]["recomputes"] == 0 and run["kv"]["decode_requests"] == 6
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_the_rate_search_alone_probes_the_headline_rate_first_and_records_each_probe_window(smollm2_dir, tmp_path):
    """`--bisect-only` (the hour-long search, run on its own): with no rounds in the same run, the headline
    rate seeds the bracket (here also the top of the range: on a quiet box one probe ends the search)."""
    out = tmp_path / "bisect.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/serve_bench.py"), "--bisect-only", "--trace", "synthetic",
           "--num-requests", "6", "--rate", "1", "--deployments", "ours_tcp", "--no-predict", "--max-model-len", "512",
           "--max-output-tokens", "8", "--model", smollm2_dir, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    found = result["max_rates"]["ours_tcp"]
    assert [s["rate"] for s in found["seeded"]] == [1.0]
    assert found["max_rate"] is None or 0.25 <= found["max_rate"] <= 1.0
    runs = result["runs"]
    assert runs[0]["rate"] == 1.0 and len(runs) == 1 + len(found["probes"])
    assert all(r["kind"] == "bisect" and r["window_size"] == 6 and r["kv"]["verified"] for r in runs)
    assert "imported" not in result  # the headline file imports from this one, not the other way round
