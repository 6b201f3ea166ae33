# SPDX-License-Identifier: Apache-2.0
"""`vllm_disagg.transport`: one small API for moving KV blocks and per-layer messages.

Read `base.py` for the contract and `README.md` for the reading path. Backends are imported only
when selected, so importing this package never needs nixl, pyverbs or a GPU. Selecting a backend
that cannot run here raises `TransportUnavailable` with one line saying what is missing; there is
no silent fallback to another backend.
"""

from __future__ import annotations

import importlib

from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport import base
from vllm_disagg.transport.base import *  # noqa: F403 - the contract is this package's API
from vllm_disagg.transport.base import Transport, TransportKind, TransportOptions

__all__ = [*base.__all__, "available_transports", "get_transport", "transport_class"]

# kind -> "module:Class"; the module is imported only when the kind is selected.
_BACKENDS = {
    TransportKind.TCP: "vllm_disagg.transport.tcp:TcpTransport",
    TransportKind.SHM: "vllm_disagg.transport.shm:ShmTransport",
    TransportKind.NIXL: "vllm_disagg.transport.nixl:NixlTransport",
    TransportKind.RDMA: "vllm_disagg.transport.rdma:RdmaTransport",
    TransportKind.MSCCLPP: "vllm_disagg.transport.mscclpp:MscclppTransport",
    TransportKind.LOOPBACK: "vllm_disagg.transport.loopback:LoopbackTransport",
}


def transport_class(kind: str | TransportKind) -> type[Transport]:
    try:
        kind = TransportKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in TransportKind)
        raise ValueError(f"unknown transport {kind!r}; known: {known}") from None
    module, _, cls = _BACKENDS[kind].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_transport(kind: str | TransportKind, options: TransportOptions) -> Transport:
    """The backend `kind`, checked to run here; raises TransportUnavailable (one line) otherwise."""
    cls = transport_class(kind)
    reason = cls.unavailable_reason()
    if reason is not None:
        raise TransportUnavailable(f"transport {cls.kind.value!r} cannot run here: {reason}")
    return cls(options)


def available_transports() -> dict[str, str | None]:
    """kind -> None if it can run here, else the reason it cannot (for `vllm-disagg doctor`)."""
    out: dict[str, str | None] = {}
    for kind in TransportKind:
        try:
            out[kind.value] = transport_class(kind).unavailable_reason()
        except Exception as err:  # a broken optional dependency must not break the report
            out[kind.value] = f"import failed: {type(err).__name__}: {err}"
    return out
