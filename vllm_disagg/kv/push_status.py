# SPDX-License-Identifier: Apache-2.0
"""Decode side: asking the prefill side how a waiting push is doing (STATUS/STATE), and acting on it.

Three answers end a receive before `push_timeout_s`:
- `failed`: P abandoned the push (preempted, cancelled, a write failed);
- `unknown`, twice in a row: P has no record of it (it restarted), so no byte will come;
- `pushing` or `done` (every write left P, not every byte landed here) with the prompt computed long
  ago: a slow link. P reports what computing the prompt took
  (`prefill_s`, about what D's recompute costs) and how long the bytes have been on the link alone
  since (`since_prefill_s`). Once that wait exceeds the compute, D cancels the push and recomputes:
  the ski-rental rule, never more than twice the faster of waiting and recomputing, without guessing
  the link's rate from landing notifications (they come a whole write at a time, and head-wise one
  fast server's half lands at once while the other's trickles). While P still computes, the push
  is compute-bound and D waits.

More: README.md, "push_status.py".
"""

from __future__ import annotations

import enum
import math
import threading
import time
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.errors import DisaggError
from vllm_disagg.kv.handshake import MsgType, SideMsg, decode_msg, encode_msg

__all__ = ["RecvState", "StatusRounds", "slow_link_reason", "slow_link_wait_s"]

logger = init_logger(__name__)
CANCEL_TIMEOUT_S = 5.0
"""How long a STATUS or CANCEL call waits for P's answer (`StatusRounds.call_timeout_s`'s default)."""
STATUS_AFTER_S = 2.0
"""A registered receive that landed no byte for this long asks its prefill instance how the push is
doing: a push P abandoned, or one P never heard of (it restarted), fails now, not at push_timeout_s."""
SLOW_AFTER_S = 0.25
"""A registered receive still incomplete this long after its registration asks too, landing or not:
the slow-link rule needs P's timing (`kv.recompute_slow_pushes`). At 1 s, every request on a slow link
took at least 1.03 s where the quiet P99 was 0.26 s (Lamina soak, stop 44)."""
REASK_FRACTION = 0.25
"""While P still computes the prompt, ask again after this share of the receive's age (at least
SLOW_AFTER_S, at most STATUS_AFTER_S): a long prefill is asked about a few times, not 4 times a second."""
MIN_LINK_WAIT_S = 0.2
"""The slow-link rule never gives up on a push that has been on the link alone for less than this:
a short prompt's last write is still in flight when its prefill ends."""
UNKNOWN_TIMES = 2
"""`unknown` answers in a row before the receive fails: the first can race a push that just completed
and was forgotten while its last notification is still queued here."""


class RecvState(enum.IntEnum):
    REGISTERING = 1
    REGISTERED = 2
    CANCELLING = 3
    DONE = 4
    FAILED = 5
    VERIFYING = 6
    """Every byte landed; waiting for P's checksums (`kv.verify_checksums`)."""


def _link_timing(body: dict[str, Any]) -> tuple[float, float] | None:
    """P's (prefill_s, since_prefill_s) from a `pushing` or `done` STATE; None while P still computes the
    prompt (or predates the timing fields, or sent something that is not two finite numbers)."""
    try:
        prefill_s, since_s = float(body["prefill_s"]), float(body["since_prefill_s"])
    except (KeyError, TypeError, ValueError):
        return None
    return (prefill_s, since_s) if math.isfinite(prefill_s) and math.isfinite(since_s) else None


def slow_link_wait_s(body: dict[str, Any]) -> float | None:
    """How much longer to wait on a push before recomputing it (<= 0: now), from P's STATE body; None
    while P still computes. D asks again exactly then, so the rule gives up when the bytes have been on
    the link alone as long as the prompt took to compute, not at the next fixed round."""
    timing = _link_timing(body)
    return None if timing is None else _wait_s(timing)


def slow_link_reason(body: dict[str, Any]) -> str | None:
    """Why a `pushing` or `done` push should be recomputed instead (P's STATE body), or None to keep waiting."""
    timing = _link_timing(body)
    return None if timing is None else _reason(timing)


def _wait_s(timing: tuple[float, float]) -> float:
    prefill_s, since_s = timing
    return max(prefill_s, MIN_LINK_WAIT_S) - since_s


def _reason(timing: tuple[float, float]) -> str | None:
    if _wait_s(timing) > 0:
        return None
    prefill_s, since_s = timing
    return (f"the push is still landing {since_s:.2f}s after its prefill ended, longer than computing "
            f"the prompt took ({prefill_s:.2f}s): a slow link, so recomputing is faster")


class StatusRounds:
    """PushReceiver's STATUS rounds (a mixin: it shares the receiver's `_lock`, `_recvs` and pools).

    Rounds to one P take turns, and one that comes within STATUS_AFTER_S of an unanswered call waits
    too: receives that stalled a poll apart made two rounds on two threads, and the second, queued on
    the connection, asked a frozen P the moment the first gave up (CI, stop 41: 0.1 s after)."""

    def _init_status(self, recompute_slow_pushes: bool) -> None:
        self.recompute_slow_pushes = recompute_slow_pushes
        self.call_timeout_s = CANCEL_TIMEOUT_S
        """How long one STATUS or CANCEL call to a prefill instance waits (a frozen P answers none)."""
        self._unanswered: dict[str, float] = {}  # prefill address -> when a STATUS call to it last timed out
        self._status_locks: dict[str, threading.Lock] = {}  # one STATUS round per prefill instance at a time

    def _due_for_status(self, recv: Any, now: float) -> bool:
        if recv.state is not RecvState.REGISTERED or recv.probing:
            return False
        return now - recv.t_progress > STATUS_AFTER_S or (self.recompute_slow_pushes and now >= recv.ask_at)

    def _probe_waiting(self, now: float) -> None:
        """One STATUS round per prefill instance for its receives that are due (on that instance's pool:
        a frozen one holds up only its own)."""
        due: dict[str, list[Any]] = {}
        with self._lock:
            for recv in self._recvs.values():
                if self._due_for_status(recv, now):
                    recv.probing = True
                    due.setdefault(recv.spec.remote, []).append(recv)
        for remote, recvs in due.items():
            self._submit(remote, self._ask_status, remote, recvs)

    def _ask_status(self, remote: str, recvs: list[Any]) -> None:
        with self._lock:
            status_lock = self._status_locks.setdefault(remote, threading.Lock())
        with status_lock:
            with self._lock:
                if time.monotonic() - self._unanswered.get(remote, -STATUS_AFTER_S) < STATUS_AFTER_S:
                    self._defer(recvs)
                    return
            self._status_round(remote, recvs)

    def _status_round(self, remote: str, recvs: list[Any]) -> None:
        for recv in recvs:
            try:
                reply = decode_msg(self._client.call(
                    remote, encode_msg(SideMsg(MsgType.STATUS, {"transfer_id": recv.spec.transfer_id})),
                    timeout=self.call_timeout_s), remote)
            except (DisaggError, OSError) as err:
                logger.info("KV push: prefill instance %s did not answer STATUS (%s)", remote, err)
                with self._lock:  # a frozen P: ask again in STATUS_AFTER_S, not on every poll
                    self._unanswered[remote] = time.monotonic()
                    for waiting in recvs:
                        waiting.last_heard = f"no answer to STATUS ({err})"
                    self._defer(recvs)
                return
            with self._lock:
                slow = self._on_state(recv, reply)
            if slow:
                self._recompute_slow(recv, slow)

    @staticmethod
    def _defer(recvs: list[Any]) -> None:
        """Called holding the lock: ask about `recvs` again only after STATUS_AFTER_S."""
        now = time.monotonic()
        for recv in recvs:
            recv.probing, recv.t_progress, recv.ask_at = False, now, now + STATUS_AFTER_S

    def _on_state(self, recv: Any, reply: SideMsg) -> str | None:
        """Called holding the lock; returns why to give up on a slow push, else None."""
        now = time.monotonic()
        recv.probing, recv.t_progress = False, now
        recv.ask_at = now + min(STATUS_AFTER_S, max(SLOW_AFTER_S, REASK_FRACTION * (now - recv.t_created)))
        if recv.state is not RecvState.REGISTERED or reply.transfer_id != recv.spec.transfer_id:
            return None
        state = reply.body.get("state") if reply.type is MsgType.STATE else None
        recv.last_heard = f"STATUS {state or reply.type.name}"
        recv.num_unknown = recv.num_unknown + 1 if state == "unknown" else 0
        if state == "failed":
            self._set_failed(recv, f"the prefill instance abandoned the push: {reply.body.get('message', '')}")
        elif recv.num_unknown >= UNKNOWN_TIMES:
            self._set_failed(recv, f"prefill instance {recv.spec.remote} has no record of the push (restarted?)")
        elif state in ("pushing", "done") and self.recompute_slow_pushes:  # done: every write left P
            timing = _link_timing(reply.body)
            if timing is not None:
                recv.ask_at = now + max(_wait_s(timing), 0.0)
                return _reason(timing)
        return None

    def _recompute_slow(self, recv: Any, reason: str) -> None:
        """CANCEL the push (P stops writing and frees its blocks) and fail the receive: vLLM recomputes."""
        with self._lock:
            if recv.state is not RecvState.REGISTERED:
                return
            recv.state = RecvState.CANCELLING
        self._record(lambda s: s.record_slow_push_recompute())
        if not self._fence_is_exact():
            self._cancel(recv, reason)  # only P's CANCEL_ACK (none of its writes in flight) makes the blocks safe
            return
        with self._lock:  # the fence stops what is still on the link, so neither waits for that link
            self._set_failed(recv, reason)
        self._send_cancel(recv.spec.remote, recv.spec.transfer_id, reason, fenced=True)
