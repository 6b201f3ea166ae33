# SPDX-License-Identifier: Apache-2.0
"""W3C trace context as it rides on the plugin's wires (base layer: no OpenTelemetry import).

A request's trace crosses processes the router never sees: the KV side-channel REGISTER (D -> P)
and the attention frames that start a step (INIT, step metadata). Those carry the binary form,
25 bytes = trace id (16) + parent span id (8) + flags (1), or nothing. `TraceContext` converts it
to and from the HTTP `traceparent` header, so a tracer (helper `obs`) fills and reads it without
the wire code knowing about spans.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_disagg.errors import ProtocolError

__all__ = ["TRACE_CONTEXT_BYTES", "TraceContext"]

TRACE_CONTEXT_BYTES = 25
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


@dataclass(frozen=True)
class TraceContext:
    """One W3C trace-context parent: which trace, which span is the parent, and its flags."""

    trace_id: bytes
    """16 bytes, not all zero."""
    parent_span_id: bytes
    """8 bytes, not all zero."""
    flags: int = 0
    """W3C trace-flags byte; bit 0 = sampled."""

    def __post_init__(self) -> None:
        if not isinstance(self.trace_id, bytes) or len(self.trace_id) != 16 or not any(self.trace_id):
            raise ValueError(f"trace_id must be 16 bytes, not all zero, got {self.trace_id!r}")
        if not isinstance(self.parent_span_id, bytes) or len(self.parent_span_id) != 8 or not any(self.parent_span_id):
            raise ValueError(f"parent_span_id must be 8 bytes, not all zero, got {self.parent_span_id!r}")
        if isinstance(self.flags, bool) or not isinstance(self.flags, int) or not 0 <= self.flags <= 0xFF:
            raise ValueError(f"flags must be one byte, got {self.flags!r}")

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    # ---- binary (the wire) -----------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return self.trace_id + self.parent_span_id + bytes((self.flags,))

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview, peer: str = "?") -> TraceContext:
        """Parse the 25-byte wire form; a wrong size or an all-zero id is a `ProtocolError`."""
        raw = bytes(raw)
        if len(raw) != TRACE_CONTEXT_BYTES:
            raise ProtocolError(f"trace context from {peer} is {len(raw)} bytes, expected {TRACE_CONTEXT_BYTES}")
        try:
            return cls(raw[:16], raw[16:24], raw[24])
        except ValueError as err:
            raise ProtocolError(f"trace context from {peer}: {err}") from None

    # ---- traceparent header (HTTP) -----------------------------------------------------------
    def to_traceparent(self) -> str:
        return f"00-{self.trace_id.hex()}-{self.parent_span_id.hex()}-{self.flags:02x}"

    @classmethod
    def from_traceparent(cls, header: str | None) -> TraceContext | None:
        """The header's context, or None when absent or invalid (W3C: restart the trace, never fail)."""
        m = _TRACEPARENT.match((header or "").strip().lower())
        if m is None or m[1] == "ff" or (m[1] == "00" and m[5]):
            return None
        try:
            return cls(bytes.fromhex(m[2]), bytes.fromhex(m[3]), int(m[4], 16))
        except ValueError:
            return None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str] | None) -> TraceContext | None:
        """From a mapping of HTTP headers (any case), e.g. vLLM's `Request.trace_headers`."""
        for name, value in (headers or {}).items():
            if name.lower() == "traceparent":
                return cls.from_traceparent(value)
        return None
