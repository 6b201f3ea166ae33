# SPDX-License-Identifier: Apache-2.0
"""serve_bench's keys that other runs measure: the transport ratios (transport_bench.py), what tracing
costs (tracing_bench.py), and the rate search with the planner's prediction at its rates
(`serve_bench.py --bisect-only`, over an hour on two cores, so run on its own). Issue 14's and 20's keys
then sit in one file, and each imported figure says which file, run and load it came from, so it is
never mistaken for one measured in this run.

    python benchmarks/serve_import.py [results/serve_bench.json]   # refresh after rerunning either
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SOURCES = {"push_vs_raw_tcp_same_streams": "transport_bench.json", "shm_vs_memcpy": "transport_bench.json",
           "tracing_overhead_ratio": "tracing_bench.json", "max_rate_ratio_vs_plain": "serve_bench_bisect.json",
           "max_rate_ratio_vs_vllm_nixl": "serve_bench_bisect.json", "planner_max_error": "serve_bench_bisect.json"}


def _provenance(name: str, source: dict) -> dict:
    load = source.get("load") or {}
    return {"from": f"benchmarks/results/{name}",
            "loadavg_before": load.get("loadavg_before") or source.get("loadavg_before") or source.get("load_first"),
            "loadavg_after": load.get("loadavg_after") or source.get("loadavg_after") or source.get("load_last"),
            **({"run_note": source["run_note"]} if source.get("run_note") else {})}


def import_keys(result: dict, results_dir: Path = RESULTS) -> dict:
    """Fill each key this run did not measure from its benchmark's committed JSON; `imported` says
    where every such figure came from (keys measured here are left alone)."""
    imported = {k: v for k, v in (result.get("imported") or {}).items() if k in SOURCES}
    for key, name in SOURCES.items():
        if result.get(key) is not None and key not in imported:
            continue
        path = results_dir / name
        source = json.loads(path.read_text()) if path.exists() else {}
        result[key] = source.get(key)
        if source.get(key) is None:
            imported.pop(key, None)
        else:
            bound = (source.get("secondary") or {}).get(f"{key}_bound")
            imported[key] = _provenance(name, source) | ({"lower_bound": bound} if bound else {})
    result["imported"] = imported
    return result


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "serve_bench.json"
    result = import_keys(json.loads(out.read_text()), out.parent)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in SOURCES} | {"imported": result["imported"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
