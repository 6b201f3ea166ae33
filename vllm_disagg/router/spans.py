# SPDX-License-Identifier: Apache-2.0
"""The router's spans inside a traced request: admission, the calls to P and D, and events.

`router.request` (server.py) is the root. `phase(name)` opens a child span for a stretch of the
request and makes it the parent of every upstream call made inside it (context.py injects its
`traceparent`), so P's and D's spans nest under `router.prefill` / `router.decode`. `event(name)`
marks routing decisions, fallbacks and replays on the current span, with their reason. All of it is
a no-op when the request is not traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm_disagg.observe import tracing
from vllm_disagg.router import context

__all__ = ["annotate", "event", "phase", "route_attrs"]


@contextlib.contextmanager
def phase(name: str, **attrs: Any) -> Iterator[Any]:
    """A child span of the current one for the `with` block (None when untraced)."""
    parent = context.current_span()
    if parent is None or not parent.is_recording():
        yield None
        return
    span = tracing.tracer().start_span(name, context=tracing.context_of(parent),
                                       attributes={f"disagg.{k}": v for k, v in attrs.items() if v is not None})
    token = context.set_span(span)
    try:
        yield span
    except BaseException as exc:
        span.record_exception(exc)
        raise
    finally:
        context.reset_span(token)
        span.end()


def event(name: str, **attrs: Any) -> None:
    """An event on the current span (e.g. `replay` with its reason)."""
    span = context.current_span()
    if span is not None and span.is_recording():
        span.add_event(name, {f"disagg.{k}": v for k, v in attrs.items() if v is not None})


def annotate(span: Any, **attrs: Any) -> None:
    """Attributes on a `phase` span (None: untraced, nothing to do)."""
    if span is not None:
        span.set_attributes({f"disagg.{k}": v for k, v in attrs.items() if v is not None})


def route_attrs(route: Any) -> dict[str, Any]:
    """A `Route`'s kind, instances and fallback reason, as `phase`/`event` keyword arguments."""
    return {"route": route.kind, "decode": route.target.url,
            "prefill": route.prefill.url if route.prefill is not None else None, "reason": route.reason}
