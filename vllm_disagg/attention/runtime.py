# SPDX-License-Identifier: Apache-2.0
"""What the remote attention impls of one process share: the `DisaggAttentionClient` the worker
(`worker.py`) installed, the pipelining runtime's overlap hook, and whether impls built from now on
declare themselves network-bound. Set by the workers, read by `remote_impl.py` and the connector."""

from __future__ import annotations

from vllm_disagg.attention.client import DisaggAttentionClient

_CLIENT: DisaggAttentionClient | None = None
_OVERLAP_HOOK = None  # callable(pending) -> None, set by the pipelining runtime (pipeline.py)
_NETWORK_BOUND = True  # what impls built from now on declare (set_network_bound)


def set_client(client: DisaggAttentionClient | None) -> None:
    global _CLIENT
    _CLIENT = client


def current_client() -> DisaggAttentionClient | None:
    """This process's attention client (installed by the remote-attention worker), or None."""
    return _CLIENT


def get_client() -> DisaggAttentionClient:
    if _CLIENT is None:
        raise RuntimeError(
            "remote attention is configured but this process has no attention client; run the engine "
            "with worker_cls='vllm_disagg.attention.worker.DisaggAttentionWorker'"
        )
    return _CLIENT


def overlap_hook():
    """The pipelining runtime's yield between submit and wait, or None."""
    return _OVERLAP_HOOK


def network_bound() -> bool:
    return _NETWORK_BOUND


def set_overlap_hook(hook) -> None:
    """Install `hook(pending)`, called between submit and wait (the pipelining runtime's yield)."""
    global _OVERLAP_HOOK
    _OVERLAP_HOOK = hook


def set_network_bound(bound: bool) -> None:
    """Whether impls built from now on declare themselves network-bound (read once per impl): the
    nano-batch executor then runs their attention on its "net" unit (n=2 ping-pong), or not (n=1)."""
    global _NETWORK_BOUND
    _NETWORK_BOUND = bound
