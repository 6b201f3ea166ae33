# SPDX-License-Identifier: Apache-2.0
"""Wire, peer and protocol failures are a `DisaggError` (config mistakes stay `ValueError`,
`config.DisaggConfigError`), so callers catch the family or one case:

    DisaggError
    ├── ProtocolError        a frame broke the wire rules (magic, version, type, sizes, ids)
    │   └── AuthError        the peer did not prove the shared token
    ├── HandshakeMismatch    both sides speak the protocol but disagree on a field (dtype, ...)
    ├── PeerLostError        the peer closed, crashed or reset the connection
    ├── TransportTimeout     a bounded wait expired (also a `TimeoutError`)
    └── TransportUnavailable a backend cannot run on this machine (what is missing, one line)
Messages say what was received, what was expected, and name the peer when known.
"""

from __future__ import annotations

__all__ = [
    "DisaggError",
    "ProtocolError",
    "AuthError",
    "HandshakeMismatch",
    "PeerLostError",
    "TransportTimeout",
    "TransportUnavailable",
]


class DisaggError(Exception):
    """Base of every inter-process failure raised by vllm-disagg."""


class ProtocolError(DisaggError):
    """A frame or message violated the wire protocol; the connection that sent it is dropped."""


class AuthError(ProtocolError):
    """The peer failed authentication with the shared token."""


class HandshakeMismatch(DisaggError):
    """Both peers are reachable but disagree on a compatibility field; never proceed with garbage."""

    def __init__(self, field: str, local: object, remote: object, peer: str | None = None):
        self.field = field
        self.local = local
        self.remote = remote
        self.peer = peer
        where = f" with peer {peer}" if peer else ""
        super().__init__(f"handshake mismatch{where} on {field!r}: local={local!r} remote={remote!r}")


class PeerLostError(DisaggError):
    """The peer went away (EOF, reset, process death) while we needed it."""


class TransportTimeout(DisaggError, TimeoutError):
    """A bounded wait on the transport expired."""


class TransportUnavailable(DisaggError):
    """The selected backend cannot run here; the message names what is missing."""
