# SPDX-License-Identifier: Apache-2.0
"""What tracing costs (issue 20): 1P+1D throughput with tracing on at the default sampling over off.

Two `vllm-disagg up --prefill 1 --decode 1` deployments of SmolLM2-135M on the same two cores, one
with every process exporting its spans (`--otlp-traces-endpoint` to a receiver in this process,
`--trace-sample-ratio` default), one without; both stay up and are loaded one at a time, alternately
(off, on, off, on, ...), by vLLM's own client: `vllm bench serve` (random dataset, fixed lengths,
closed loop at `--max-concurrency`, so the figure is saturated throughput). The headline,
`tracing_overhead_ratio`, is the median over pairs of output tokens/s on / off (1.0 = free).

    python benchmarks/tracing_bench.py --quick   # 2 pairs, one JSON object on stdout
    python benchmarks/tracing_bench.py           # 3 pairs + results/tracing_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_disagg.observe.collector import SpanCollector  # noqa: E402
from vllm_disagg.observe.tracing import DEFAULT_SAMPLE_RATIO  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VLLM_ARGS = ["--max-model-len", "2048", "--no-enable-prefix-caching", "--max-num-seqs", "32", "--enforce-eager"]


def log(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def start_up(tmp: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    state = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "vllm_disagg.cli.main", "up", "--prefill", "1", "--decode", "1", "--port", "0",
           "--model", "smollm2-135m", "--state-file", str(state), "--log-dir", str(tmp / f"{name}-logs"),
           *extra, *VLLM_ARGS]
    proc = subprocess.Popen(cmd, stdout=open(tmp / f"{name}.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while not state.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not come up:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
        time.sleep(1)
    return proc, json.loads(state.read_text())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(state: dict, tmp: Path, tag: str, args: argparse.Namespace) -> dict:
    """One `vllm bench serve` run against the router; its saved result."""
    from vllm_disagg.models import resolve_model

    cmd = ["vllm", "bench", "serve", "--backend", "openai", "--base-url", state["endpoint"], "--model", state["model"],
           "--tokenizer", resolve_model("smollm2-135m"), "--dataset-name", "random", "--random-input-len",
           str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts",
           str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp), "--result-filename", f"{tag}.json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    result = json.loads((tmp / f"{tag}.json").read_text())
    if result.get("completed") != args.num_prompts:
        raise SystemExit(f"{tag}: only {result.get('completed')} of {args.num_prompts} requests completed")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pairs", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    args.pairs = args.pairs or (2 if args.quick else 3)
    args.num_prompts = args.num_prompts or (24 if args.quick else 48)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    tmp = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    collector = SpanCollector(tmp / "spans.jsonl").start()
    procs = []
    try:
        off_proc, off = start_up(tmp, "off", [])
        procs.append(off_proc)
        on_proc, on = start_up(tmp, "on", ["--otlp-traces-endpoint", collector.grpc_endpoint])
        procs.append(on_proc)
        bench(off, tmp, "warmup-off", argparse.Namespace(**{**vars(args), "num_prompts": 4}))
        bench(on, tmp, "warmup-on", argparse.Namespace(**{**vars(args), "num_prompts": 4}))
        runs = []
        for i in range(args.pairs):
            r_off = bench(off, tmp, f"off{i}", args)
            r_on = bench(on, tmp, f"on{i}", args)
            runs.append({"off_output_tok_s": r_off["output_throughput"], "on_output_tok_s": r_on["output_throughput"],
                         "off_ttft_p50_ms": r_off["median_ttft_ms"], "on_ttft_p50_ms": r_on["median_ttft_ms"],
                         "ratio": r_on["output_throughput"] / r_off["output_throughput"]})
            log(f"pair {i}: off {r_off['output_throughput']:.1f} tok/s, on {r_on['output_throughput']:.1f} tok/s")
        time.sleep(1.0)  # the last exports
    finally:
        for proc in procs:
            stop(proc)
        collector.stop()
    traced = {s["trace_id"] for s in collector.spans if s["name"] == "router.request"}
    result = {
        "tracing_overhead_ratio": round(statistics.median(r["ratio"] for r in runs), 4),
        "sample_ratio": DEFAULT_SAMPLE_RATIO,
        "pairs": runs,
        "traced_requests": len(traced),
        "spans_per_request": round(sum(s["trace_id"] in traced for s in collector.spans) / max(1, len(traced)), 1),
        "workload": {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "max_concurrency": args.concurrency,
                     "model": "smollm2-135m", "deployment": "vllm-disagg up --prefill 1 --decode 1 (cores 0, 1)"},
        "loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(json.dumps(result))
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "tracing_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
