# SPDX-License-Identifier: Apache-2.0
"""Where one request's time went: its trace as a text waterfall, with the critical path marked.

Input is the spans of `collector.SpanCollector` (JSONL, one flat span per line). `find_trace` picks
the trace of a request id (the router's `x-request-id`, a vLLM request id, or a trace id); the
critical path walks back from the end of each span through the child that finished last, as in
Jaeger's critical-path view, and `coverage` says how much of a span its critical children explain.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUEST_ID_KEYS = ("disagg.request_id", "gen_ai.request.id", "http.request_id")
_BAR = 40
_TIE_NS, _TIE_SHARE = 2_000_000, 0.02  # ends this close count as simultaneous (see critical_children)

__all__ = ["Trace", "find_trace", "load_spans", "render"]


def load_spans(path: str | Path) -> list[dict[str, Any]]:
    """Every span of a span file: our receiver's JSONL, or the OTLP-JSON lines an OpenTelemetry
    Collector's `file` exporter writes (`{"resourceSpans": ...}`). Lines that are not JSON are skipped
    (a file being written)."""
    spans = []
    with Path(path).open() as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "resourceSpans" in obj:
                spans += _from_otlp_json(line)
            elif isinstance(obj, dict) and "span_id" in obj:
                spans.append(obj)
    return spans


def _from_otlp_json(line: str) -> list[dict[str, Any]]:
    """OTLP/JSON writes ids as hex (protobuf's JSON mapping would read them as base64)."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from vllm_disagg.observe.collector import request_spans

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: _b64(v) if k in _ID_KEYS and isinstance(v, str) else fix(v) for k, v in node.items()}
        return [fix(v) for v in node] if isinstance(node, list) else node

    message = json_format.ParseDict(fix(json.loads(line)), ExportTraceServiceRequest(), ignore_unknown_fields=True)
    return request_spans(message)


_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _b64(value: str) -> str:
    import base64

    try:
        return base64.b64encode(bytes.fromhex(value)).decode()
    except ValueError:
        return value  # already base64 (protobuf's own JSON mapping)


@dataclass
class Trace:
    """The spans of one trace, linked parent -> children."""

    spans: list[dict[str, Any]]
    children: dict[str | None, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        """Link spans to their parents; a span whose parent is missing, or whose ancestry loops (span
        ids reused by a seeded id generator), becomes a root, so walking the tree always ends."""
        by_id = {s["span_id"]: s for s in self.spans}
        for s in sorted(self.spans, key=lambda s: (s["start_ns"], -s["end_ns"])):
            parent = s["parent_span_id"] if s["parent_span_id"] in by_id else None
            seen, up = {s["span_id"]}, parent
            while up is not None and up not in seen:
                seen.add(up)
                up = by_id[up]["parent_span_id"] if by_id[up]["parent_span_id"] in by_id else None
            self.children[None if up is not None else parent].append(s)

    @property
    def roots(self) -> list[dict[str, Any]]:
        return self.children[None]

    @property
    def root(self) -> dict[str, Any]:
        """The earliest span without a parent in the trace (the router's request span)."""
        return self.roots[0]

    @property
    def orphans(self) -> list[dict[str, Any]]:
        """Spans whose parent is not in the trace: usually not exported yet (each process's batch
        exporter flushes on its own schedule), so the waterfall is incomplete."""
        ids = {s["span_id"] for s in self.spans}
        return [s for s in self.spans if s["parent_span_id"] and s["parent_span_id"] not in ids]

    @property
    def services(self) -> set[str]:
        return {s["service"] for s in self.spans}

    @property
    def processes(self) -> set[str]:
        return {s.get("process") or s["service"] for s in self.spans}

    def named(self, name: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["name"] == name]

    def critical_path(self, span: dict[str, Any] | None = None,
                      window: tuple[int, int] | None = None) -> list[tuple[dict[str, Any], int, int]]:
        """(span, start, end) of each span on the critical path of `span` (default the root), depth
        first: the part of its time (its window) that the end of the request waited on."""
        span = span or self.root
        lo, hi = window or (span["start_ns"], span["end_ns"])
        path = [(span, lo, hi)]
        for child, c_lo, c_hi in self.critical_children(span, (lo, hi)):
            path += self.critical_path(child, (c_lo, c_hi))
        return path

    def critical_children(self, span: dict[str, Any],
                          window: tuple[int, int] | None = None) -> list[tuple[dict[str, Any], int, int]]:
        """Walking back from the window's end: the child that ended last before the cursor, then the
        cursor moves to its start; (child, start, end) clipped to the window, in time order.

        A summary span, a leaf whose time its siblings explain (vLLM's `llm_request` beside the
        engine's own spans), is left out while other children are there. Children ending within
        `_TIE` of the latest count as equally late; among them a child that really ends there beats
        one that runs on past the cursor (it was not waited on), then the one that started last."""
        lo, hi = window or (span["start_ns"], span["end_ns"])
        cursor, picked = hi, []
        kids = self.children[span["span_id"]]
        summaries = [c for c in kids if _is_summary(c, kids, self.children)]
        todo = [c for c in kids if c not in summaries] or summaries
        tie = max(_TIE_NS, (hi - lo) * _TIE_SHARE)
        while todo and cursor > lo:
            live = [c for c in todo if c["start_ns"] < cursor and c["end_ns"] > lo]
            if not live:
                break
            latest = max(min(c["end_ns"], cursor) for c in live)
            best = max((c for c in live if min(c["end_ns"], cursor) >= latest - tie),
                       key=lambda c: (c["end_ns"] <= cursor + tie, c["start_ns"], c["start_ns"] - c["end_ns"]))
            picked.append((best, max(best["start_ns"], lo), min(best["end_ns"], cursor)))
            cursor = best["start_ns"]
            todo.remove(best)
        return picked[::-1]

    def coverage(self, span: dict[str, Any] | None = None) -> float:
        """Share of `span`'s duration covered by its critical children."""
        span = span or self.root
        dur = span["end_ns"] - span["start_ns"]
        if dur <= 0:
            return 1.0
        return sum(end - start for _, start, end in self.critical_children(span)) / dur


def _is_summary(span: dict[str, Any], siblings: list[dict[str, Any]],
                children: dict[str | None, list[dict[str, Any]]]) -> bool:
    """A leaf that shorter siblings cover for at least 90 %: it adds no detail of its own."""
    if children.get(span["span_id"]):
        return False
    lo, hi = span["start_ns"], span["end_ns"]
    if hi <= lo:
        return False
    covered, cursor = 0, lo
    shorter = [s for s in siblings if s is not span and s["end_ns"] - s["start_ns"] < hi - lo]
    for s in sorted(shorter, key=lambda s: s["start_ns"]):
        start, end = max(s["start_ns"], cursor), min(s["end_ns"], hi)
        if end > start:
            covered += end - start
            cursor = end
    return covered >= 0.9 * (hi - lo)


def group_traces(spans: Iterable[dict[str, Any]]) -> dict[str, Trace]:
    by_trace: dict[str, list] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    return {tid: Trace(ss) for tid, ss in by_trace.items()}


def find_trace(spans: Iterable[dict[str, Any]], request_id: str) -> Trace | None:
    """The trace of `request_id`: a trace id, or a request id on one of its spans (exact, else a
    vLLM id that embeds it, e.g. `cmpl-<id>-0`). The latest such trace when several match."""
    traces = group_traces(spans)
    if request_id in traces:
        return traces[request_id]
    exact, partial = [], []
    for t in traces.values():
        values = [str(s["attributes"].get(k, "")) for s in t.spans for k in REQUEST_ID_KEYS]
        if request_id in values:
            exact.append(t)
        elif any(request_id in v for v in values if v):
            partial.append(t)
    found = exact or partial
    return max(found, key=lambda t: t.root["start_ns"]) if found else None


def render(t: Trace, events: bool = False, width: int = _BAR) -> str:
    """The waterfall: offset and duration in ms, a bar, the span (indented by depth) and its process;
    `*` marks the critical path. Span events show as one summary line per name unless `events`."""
    root = t.root
    t0, total = root["start_ns"], max(1, root["end_ns"] - root["start_ns"])
    critical = {s["span_id"] for s, _, _ in t.critical_path()}
    lines = [f"trace {root['trace_id']}  {total / 1e6:.1f} ms  {len(t.spans)} spans from "
             f"{len(t.processes)} processes  (critical path: *)",
             f"{'start':>9} {'dur':>9}  {'':<{width}}  span [process]"]
    if t.orphans:
        lines.insert(1, f"incomplete: the parents of {len(t.orphans)} spans are not here (not exported yet: "
                        "each process exports every few seconds; run it again)")

    def bar(start: int, end: int) -> str:
        a = max(0, min(width - 1, int((start - t0) * width / total)))
        b = max(a + 1, min(width, round((end - t0) * width / total)))
        return " " * a + "█" * (b - a) + " " * (width - b)

    def walk(span: dict[str, Any], depth: int) -> None:
        mark = "*" if span["span_id"] in critical else " "
        lines.append(f"{(span['start_ns'] - t0) / 1e6:9.1f} {(span['end_ns'] - span['start_ns']) / 1e6:9.1f}  "
                     f"{bar(span['start_ns'], span['end_ns'])} {mark}{'  ' * depth}{span['name']} "
                     f"[{_where(span)}]{_summary(span['attributes'])}")
        lines.extend(_event_lines(span, t0, depth, width, events))
        for child in t.children[span["span_id"]]:
            walk(child, depth + 1)

    for r in t.roots:
        walk(r, 0)
    lines.append(f"critical path covers {t.coverage() * 100:.1f} % of the root span; time on it by span "
                 "(self time):")
    for name, ns in _self_times(t):
        lines.append(f"  {ns / 1e6:9.1f} ms  {name}")
    return "\n".join(lines)


_SHOWN_ATTRS = ("disagg.route", "disagg.reason", "disagg.bytes", "disagg.num_layers", "disagg.exposed_ms",
                "disagg.num_prompt_tokens", "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                "disagg.instance", "http.status_code")


def _where(span: dict[str, Any]) -> str:
    """The span's process without its pid: `vllm-disagg-decode0/EngineCore`."""
    return (span.get("process") or span["service"]).rsplit(":", 1)[0]


def _summary(attrs: dict[str, Any]) -> str:
    shown = [f"{k.split('.', 1)[1]}={attrs[k]}" for k in _SHOWN_ATTRS if k in attrs]
    return f"  ({', '.join(shown)})" if shown else ""


def _event_lines(span: dict[str, Any], t0: int, depth: int, width: int, every: bool) -> list[str]:
    pad = " " * (20 + width) + "  " * (depth + 1)
    if every:
        return [f"{(e['time_ns'] - t0) / 1e6:9.1f} {'':>9}  {pad[20:]}· {e['name']}{_summary(e['attributes'])}"
                f" {_plain(e['attributes'])}" for e in span["events"]]
    by_name: dict[str, list] = defaultdict(list)
    for e in sorted(span["events"], key=lambda e: e["time_ns"]):
        by_name[e["name"]].append(e)
    out = []
    for name, evs in by_name.items():
        when = (evs[0]["time_ns"] - t0) / 1e6
        what = f"{len(evs)}x {name}" if len(evs) > 1 else f"{name} {_plain(evs[0]['attributes'])}"
        out.append(f"{when:9.1f} {'':>9}  {pad[20:]}· {what}")
    return out


def _plain(attrs: dict[str, Any]) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in attrs.items())


def _self_times(t: Trace) -> list[tuple[str, int]]:
    """Critical-path time by span name: each span's window less what its own critical children cover.
    A layer-wise push runs beside P's prefill: its time before the `prefill_done` event is P still
    computing layers, not transfer, and is named so (the part after it is the exposed push)."""
    totals: dict[str, int] = defaultdict(int)
    for span, lo, hi in t.critical_path():
        windows = [(start, end) for _, start, end in t.critical_children(span, (lo, hi))]
        name = f"{span['name']} [{_where(span)}]"
        done = next((e["time_ns"] for e in span["events"] if e["name"] == "prefill_done"), None)
        if done is not None and lo < done < hi:
            totals[f"{name} waiting for P's prefill layers"] += _uncovered(lo, done, windows)
            lo = done
        totals[name] += _uncovered(lo, hi, windows)
    return sorted(totals.items(), key=lambda kv: -kv[1])


def _uncovered(lo: int, hi: int, windows: list[tuple[int, int]]) -> int:
    """Nanoseconds of [lo, hi) outside the (disjoint) windows."""
    return (hi - lo) - sum(max(0, min(end, hi) - max(start, lo)) for start, end in windows)
