# SPDX-License-Identifier: Apache-2.0
"""Structured logs: every line of every process as one JSON object with its request id and trace id.

`JsonFormatter` is used by the router, the attention servers and, through vLLM's own hook
(`VLLM_LOGGING_CONFIG_PATH`, `vllm_logging_config()`), by every vLLM process (API server,
EngineCore, workers). A line gets `request_id`/`trace_id` from (in order) the record's `extra`, the
context the router binds per request (`bind`), or a vLLM request id in the message (`cmpl-...`), whose
trace the connector remembered (`remember_trace`). `TextFormatter` appends the same ids to the
classic line. `vllm-disagg logs` merges a deployment's files and filters them by id.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import time
from collections import OrderedDict

_CONTEXT: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "disagg_log_context", default=(None, None))
_TRACES: OrderedDict[str, str] = OrderedDict()  # vLLM request id -> trace id (traced requests only)
_MAX_TRACES = 4096
# vLLM's request ids as they appear in its messages: cmpl-<id>-<n>[-<8 chars>], chatcmpl-..., resp_...
_REQUEST_ID = re.compile(r"\b((?:cmpl|chatcmpl|resp|msg|gen)[-_][0-9A-Za-z_-]{6,})")
_FIELDS = ("request_id", "trace_id")

__all__ = ["JsonFormatter", "TextFormatter", "bind", "configure", "remember_trace", "vllm_logging_config"]


def bind(request_id: str | None, trace_id: str | None = None) -> contextvars.Token:
    """Ids for every log line of the current context (the router's request handler and its tasks)."""
    return _CONTEXT.set((request_id, trace_id))


def remember_trace(request_id: str, trace_id: str) -> None:
    """Lines of this process that name `request_id` get `trace_id` too (bounded, newest kept)."""
    _TRACES[request_id] = trace_id
    while len(_TRACES) > _MAX_TRACES:
        _TRACES.popitem(last=False)


def ids(record: logging.LogRecord) -> tuple[str | None, str | None]:
    request_id, trace_id = getattr(record, "request_id", None), getattr(record, "trace_id", None)
    if request_id is None and trace_id is None:
        request_id, trace_id = _CONTEXT.get()
    if request_id is None:
        match = _REQUEST_ID.search(record.getMessage())
        request_id = match.group(1) if match else None
    if trace_id is None and request_id is not None:
        trace_id = _TRACES.get(request_id) or next(
            (t for r, t in reversed(_TRACES.items()) if request_id.startswith(r) or r.startswith(request_id)), None)
    if trace_id is None:
        trace_id = _current_trace_id()
    return request_id, trace_id


def _current_trace_id() -> str | None:
    from opentelemetry import trace

    sc = trace.get_current_span().get_span_context()
    return f"{sc.trace_id:032x}" if sc.is_valid else None


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, process, pid, msg, request_id, trace_id[, exc]."""

    def __init__(self, *args, service: str | None = None, **kwargs) -> None:
        kwargs.pop("log_level", None)  # vLLM's formatter kwarg, when its config is reused
        super().__init__(*args, **kwargs)
        self.service = service or os.environ.get("OTEL_SERVICE_NAME")

    def format(self, record: logging.LogRecord) -> str:
        request_id, trace_id = ids(record)
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name,
            "process": getattr(record, "vllm_process_name", None) or record.processName, "pid": record.process,
            "msg": record.getMessage(),
        }
        if self.service:
            out["service"] = self.service
        if request_id:
            out["request_id"] = request_id
        if trace_id:
            out["trace_id"] = trace_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """The classic line, plus ` [request_id=... trace_id=...]` when they are known."""

    def __init__(self, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s", *args, **kwargs) -> None:
        kwargs.pop("log_level", None)
        super().__init__(fmt, *args, **kwargs)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        found = [f"{k}={v}" for k, v in zip(_FIELDS, ids(record), strict=True) if v]
        return f"{line} [{' '.join(found)}]" if found else line


def configure(fmt: str = "text", service: str | None = None, level: int = logging.INFO,
              path: str | os.PathLike | None = None) -> None:
    """Root logging of a non-vLLM process (router, attention server, `up`): stderr in `fmt`, or, with
    `path`, the file in `fmt` and stderr as text (the console of `vllm-disagg up` stays readable)."""
    formatter = JsonFormatter(service=service) if fmt == "json" else TextFormatter()
    console = logging.StreamHandler()
    console.setFormatter(TextFormatter() if path is not None else formatter)
    handlers: list[logging.Handler] = [console]
    if path is not None:
        handlers.append(logging.FileHandler(path))
        handlers[-1].setFormatter(formatter)
    logging.basicConfig(level=level, handlers=handlers, force=True)


def vllm_logging_config(fmt: str = "json") -> dict:
    """A `VLLM_LOGGING_CONFIG_PATH` config: vLLM's own handler (stdout, INFO) with our formatter, for
    `vllm.*` and (through it, see `vllm_disagg._share_vllm_logging`) `vllm_disagg.*`."""
    cls = "JsonFormatter" if fmt == "json" else "TextFormatter"
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"disagg": {"()": f"vllm_disagg.observe.logs.{cls}"}},
        "handlers": {"disagg": {"class": "logging.StreamHandler", "formatter": "disagg",
                                "stream": "ext://sys.stdout", "level": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}},
        "loggers": {"vllm": {"handlers": ["disagg"], "level": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
                             "propagate": False}},
    }
