# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg trace REQUEST_ID`: where one request's time went, from a local span file.

    vllm-disagg trace --state-file s.json ID   # spans of `vllm-disagg up --trace --state-file s.json`
    vllm-disagg trace --spans spans.jsonl ID   # any file the local receiver wrote
    vllm-disagg trace --spans F --slowest 5    # the slowest requests in the file, one line each

REQUEST_ID is the router's `x-request-id` (the client's own `X-Request-Id` when it sent one), a vLLM
request id, or a trace id. No collector service is needed: `up --trace` runs the receiver
(`observe/collector.py`) and every process exports to it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("trace", help="show where a request's time went (text waterfall of its trace)",
                                   description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("request_id", nargs="?", help="x-request-id, vLLM request id or trace id")
    parser.add_argument("--spans", default=None,
                        help="span file (JSONL) of the local receiver (default: the one in --state-file)")
    parser.add_argument("--state-file", default=None, help="state file of `vllm-disagg up --trace --state-file F`")
    parser.add_argument("--slowest", type=int, default=0, metavar="N", help="list the N slowest requests instead")
    parser.add_argument("--events", action="store_true", help="show every span event (e.g. each layer's write)")
    parser.add_argument("--json", action="store_true", help="print the trace's spans as JSON")
    parser.set_defaults(func=run)
    return parser


def span_file(args: argparse.Namespace) -> Path:
    if args.spans:
        return Path(args.spans)
    if not args.state_file:
        raise SystemExit("vllm-disagg trace: give --spans FILE or --state-file F (of `vllm-disagg up --trace`)")
    state_path = Path(args.state_file)
    try:
        state = json.loads(state_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"vllm-disagg trace: no --spans file and no readable state file {state_path} ({err})") from None
    if not state.get("trace_file"):
        raise SystemExit(f"vllm-disagg trace: {state_path} has no span file: start `vllm-disagg up` with --trace")
    return Path(state["trace_file"])


def run(args: argparse.Namespace) -> int:
    from vllm_disagg.observe.waterfall import find_trace, group_traces, load_spans, render

    path = span_file(args)
    if not path.exists():
        raise SystemExit(f"vllm-disagg trace: {path} does not exist")
    spans = load_spans(path)
    if args.slowest:
        traces = sorted(group_traces(spans).values(), key=lambda t: t.root["start_ns"] - t.root["end_ns"])
        for t in traces[: args.slowest]:
            r = t.root
            rid = next((str(s["attributes"][k]) for s in t.spans for k in ("disagg.request_id",)
                        if k in s["attributes"]), r["trace_id"])
            print(f"{(r['end_ns'] - r['start_ns']) / 1e6:9.1f} ms  {rid}  {r['name']} [{r['service']}]  "
                  f"{len(t.spans)} spans")
        return 0
    if not args.request_id:
        raise SystemExit("vllm-disagg trace: give a REQUEST_ID (or --slowest N)")
    t = find_trace(spans, args.request_id)
    if t is None:
        raise SystemExit(f"vllm-disagg trace: no trace of {args.request_id!r} among {len(spans)} spans in {path} "
                         "(not sampled, or not exported yet: processes export every few seconds)")
    print(json.dumps(t.spans, indent=1) if args.json else render(t, events=args.events))
    return 0
