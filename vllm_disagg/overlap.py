# SPDX-License-Identifier: Apache-2.0
"""Public overlap API for code that runs inside a nano-batched step (see docs/design/overlap_api.md).

- An attention impl whose forward is network-bound (remote attention) sets the class attribute
  `nanoflow_network_bound = True`; the executor then runs that layer's attention ops on the "net"
  unit, so a blocking RPC of nano-batch i overlaps dense compute of the other nano-batches.
- `submit_network(fn)` runs network side work (e.g. a KV push) on a FIFO side thread; the executor
  drains these futures before the step returns.
- `current_nano_batch()` tells code which nano-batch/op it is running for (thread-local).
- `deferred_waits()` / `defer_wait(fn)`: split a network-bound op into its send (right after the
  KQV, on the dense unit) and its wait (later, on the "net" unit), so the next nano-batch's request
  is already queued at the server while the previous one computes (no server idle between them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

STEP_DRAIN_TIMEOUT_S = 60.0
NETWORK_BOUND_ATTR = "nanoflow_network_bound"


@dataclass(frozen=True)
class NanoBatchInfo:
    index: int
    count: int
    layer: int
    op: str


_local = threading.local()
_side_lock = threading.Lock()
_side_pool: ThreadPoolExecutor | None = None
_pending: list[Future] = []


def is_network_bound(attn_layer: Any) -> bool:
    """True when the layer's attention impl declared itself network-bound."""
    impl = getattr(attn_layer, "impl", attn_layer)
    return bool(getattr(impl, NETWORK_BOUND_ATTR, False))


def current_nano_batch() -> NanoBatchInfo | None:
    return getattr(_local, "info", None)


def set_current_nano_batch(info: NanoBatchInfo | None) -> None:
    _local.info = info


def submit_network(fn, *args: Any, **kwargs: Any) -> Future:
    """Run `fn(*args, **kwargs)` on the side-network thread (FIFO); returns its Future."""
    global _side_pool
    with _side_lock:
        if _side_pool is None:
            _side_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoflow-net-side")
        fut = _side_pool.submit(fn, *args, **kwargs)
        _pending.append(fut)
    return fut


def drain_network(timeout_s: float = STEP_DRAIN_TIMEOUT_S) -> None:
    """Wait for all side work submitted so far; re-raise its first error."""
    with _side_lock:
        pending = list(_pending)
        _pending.clear()
    for fut in pending:
        try:
            fut.result(timeout=timeout_s)
        except FutureTimeout:
            raise TimeoutError(
                f"nanoflow: network side work did not finish within {timeout_s}s; "
                "is a peer dead? (overlap.STEP_DRAIN_TIMEOUT_S)"
            ) from None


@contextmanager
def deferred_waits() -> Iterator[list[Callable[[], Any]]]:
    """Collect the waits that network-bound ops called inside register with `defer_wait` (this
    thread only); the caller must run every one of them, in order, before using their outputs."""
    outer = getattr(_local, "deferred", None)
    _local.deferred = waits = []
    try:
        yield waits
    finally:
        _local.deferred = outer


def defer_wait(fn: Callable[[], Any]) -> bool:
    """Inside `deferred_waits()`: keep `fn` (the op's blocking wait) for the caller and return True,
    so the op returns after sending. Elsewhere return False: the op waits itself, as usual."""
    waits = getattr(_local, "deferred", None)
    if waits is None:
        return False
    waits.append(fn)
    return True


def wait_network(fn: Callable[[], Any]) -> Any:
    """Run a network-bound op's blocking wait `fn()`. In a turn-taking step (`nanoflow/pingpong.py`:
    models off the Llama op path) the thread gives up its turn while it is blocked, so another
    nano-batch computes meanwhile (its dense layers, MoE experts included), and takes it back afterwards."""
    turn = getattr(_local, "turn", None)
    return fn() if turn is None else turn.wait(fn)


def set_turn(turn: Any) -> None:
    """This thread's `pingpong` turn (None: not in a turn-taking step)."""
    _local.turn = turn
