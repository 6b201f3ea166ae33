# SPDX-License-Identifier: Apache-2.0
"""Unit-test fixtures. One exporting tracer provider for the whole test process (OpenTelemetry allows one per process),
recording into memory; `spans` hands a test the spans it produced."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER = InMemorySpanExporter()


def _install() -> None:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)


@pytest.fixture
def spans():
    """A callable returning the spans finished since the test began."""
    _install()
    _EXPORTER.clear()
    return _EXPORTER.get_finished_spans
