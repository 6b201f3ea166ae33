# SPDX-License-Identifier: Apache-2.0
"""The API server's side of `/live`: beats received, generate requests in flight, and the verdict
(`LiveState.report`), with the stall limit that the router applies too (`stall_limit_for`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque

from vllm_disagg.liveness import beacon
from vllm_disagg.liveness.beacon import ALIVE, BEAT, LAYER, RECOVERY, socket_name

__all__ = ["LONG_STEP_MARGIN", "LiveState", "live_state", "stall_limit_for", "stall_timeout_s"]

logger = logging.getLogger(__name__)
ENV_STALL_TIMEOUT = "VLLM_DISAGG_STALL_TIMEOUT_S"
_NUM_STEP_SAMPLES = 64
MIN_STEP_SAMPLES = 3
"""Busy steps seen before `expected_step_s` is reported. Each sample over-states its step (beats are at
most one per 50 ms), so a few are safe; 8 left a restarted engine on the fixed limit for minutes at
low load (a short request gives 1-3 samples), and the chaos soak's 7.7 s SIGSTOP of it went uncut."""
RECOVERY_STALE_S = 3.0
"""A recovery whose worker said nothing for this long is over (the worker repeats it every second)."""
MIN_STEP_S = 1e-3
"""A sample shorter than this is a clock artefact, not a step (no engine steps in under a millisecond)."""


LONG_STEP_MARGIN = 3.0
"""A step expected to take E seconds counts as stalled only past this many times E, the fixed timeout
notwithstanding: a 1920-token prompt is one prefill step of ~12-15 s in float32 on one AVX2 core, and
the router cut that healthy prefill instance at 10 s and recomputed the prompt on decode (stop 38).
E scales the engine's fastest recent step linearly to the step's tokens, which under-states a long
prompt's attention: hence a margin, not E itself. Once the step's layers report progress
(`LayerBeacon`), E is one layer's share of the step (`LiveState.expected_progress_s`)."""


def stall_limit_for(expected_s: object, timeout_s: float) -> float:
    """The fixed stall timeout, raised where the next sign of progress is expected to take long:
    `expected_s` is the expected wait for it (`expected_progress_s` in `/live`), `LONG_STEP_MARGIN`."""
    if not isinstance(expected_s, (int, float)) or expected_s <= 0:
        return timeout_s
    return max(timeout_s, LONG_STEP_MARGIN * float(expected_s))


class LiveState:
    """API server side: beats received, generate requests in flight, and the verdict."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or socket_name(os.getpid())
        self.inflight = 0
        self.num_beats = 0
        self.engine_busy = False
        self._owed: dict[int, float] = {}
        """Arrival times of requests the engine may owe a step: in flight, or ended unanswered (cut or
        disconnected) since the last beat. Every beat clears them; a complete answer clears its own."""
        self._num_requests = 0
        self.last_alive: float | None = None
        """EngineCore's last heartbeat (`StepBeacon.start_heartbeat`); None if it sends none."""
        now = time.monotonic()
        self.last_beat = self.last_chunk = self.work_since = now
        self.num_step_tokens = 0
        """Tokens of the step that started at the last beat (0: the engine went idle)."""
        self.last_layer = 0.0
        """The last layer-progress datagram (`LayerBeacon`): the step in progress moves."""
        self.num_layers = 0
        """Layers per step, as the last layer datagram said (0: none came yet)."""
        self.recovering_since: float | None = None
        """When the model worker began rebuilding what a lost attention server held (None: it is not)."""
        self.last_recovery = 0.0
        self._steps: deque[tuple[float, int]] = deque(maxlen=_NUM_STEP_SAMPLES)
        """(seconds from one busy beat to the next, tokens of the first): an upper bound on that step's
        time, since beats are at most one per 50 ms."""
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind("\0" + self.name)
        except OSError as err:  # another API server took the name: report "unknown", never fail serving
            logger.warning("liveness: cannot listen on @%s (%s); /live reports no engine progress", self.name, err)
            self._sock.close()
            return
        threading.Thread(target=self._listen, name="disagg-live", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                data = self._sock.recv(64)
            except OSError:
                return
            if len(data) == ALIVE.size:
                self.last_alive = time.monotonic()
            elif len(data) == BEAT.size:  # only EngineCore writes here (abstract sockets: same user)
                _, num_tokens, started = BEAT.unpack(data)
                self.beat(num_tokens, min(started, time.monotonic()))
            elif len(data) == LAYER.size:
                _, _, num_layers = LAYER.unpack(data)
                self.layer_done(num_layers, time.monotonic())
            elif len(data) == RECOVERY.size:
                _, on, began = RECOVERY.unpack(data)
                self.recovery(bool(on), min(began, time.monotonic()), time.monotonic())

    def beat(self, num_tokens: int, now: float) -> None:
        """EngineCore started a step of `num_tokens` tokens (0: it has nothing to do) at `now`."""
        with self._lock:
            if self.num_beats and self.engine_busy and now - self.last_beat >= MIN_STEP_S:
                self._steps.append((now - self.last_beat, self.num_step_tokens))
            self.num_beats += 1
            self.last_beat = now
            self.engine_busy = num_tokens > 0
            self.num_step_tokens = num_tokens
            self._owed.clear()

    def layer_done(self, num_layers: int, now: float) -> None:
        """A layer of the step in progress finished at `now` (one of `num_layers` per step)."""
        with self._lock:
            self.last_layer = now
            self.num_layers = num_layers

    def recovery(self, on: bool, began: float, now: float) -> None:
        """The worker is recovering from a lost attention server since `began` (`on`), or is done."""
        with self._lock:
            self.recovering_since, self.last_recovery = (began if on else None), now

    def _recovering_s(self, now: float) -> float | None:
        if self.recovering_since is None or now - self.last_recovery > RECOVERY_STALE_S:
            return None
        return round(max(0.0, now - self.recovering_since), 3)

    @property
    def step_layer_progress(self) -> bool:
        """A layer datagram came since the step in progress started: its wait is one layer's, not all."""
        return self.num_layers > 0 and self.last_layer > self.last_beat

    def expected_step_s(self) -> float | None:
        """How long the step in progress should take, judged by this engine's recent steps: the most
        optimistic of them scaled up to its token count (a step of more tokens than a sample is
        assumed proportionally slower, never faster). None before `MIN_STEP_SAMPLES` busy steps.
        The router's adaptive stall limit is a multiple of it (router/README.md, "Hang detection")."""
        if len(self._steps) < MIN_STEP_SAMPLES:
            return None
        num_tokens = max(1, self.num_step_tokens)
        return min(gap * max(1.0, num_tokens / max(1, tokens)) for gap, tokens in self._steps)

    def expected_progress_s(self, expected_step_s: float | None) -> float | None:
        """The expected wait for the next sign of progress: the whole step's, or one layer's share of it
        once this step's layers report (`LayerBeacon`; that is the wait a stall limit must allow)."""
        if expected_step_s is None or not self.step_layer_progress:
            return expected_step_s
        return expected_step_s / self.num_layers

    @property
    def owed_since(self) -> float | None:
        """The oldest request the engine may owe a step (None: nothing owed)."""
        return min(self._owed.values(), default=None)

    def request_started(self) -> int:
        """Count a generate request in; the returned id goes back to `request_ended`."""
        with self._lock:
            now = time.monotonic()
            if self.inflight == 0:
                self.work_since = now
            self._num_requests += 1
            self._owed[self._num_requests] = now
            self.inflight += 1
            return self._num_requests

    def request_ended(self, request_id: int | None = None, answered: bool = False) -> None:
        """`answered`: its whole response went out (a 400 from validation, a tokenizer call, or the
        engine's answer), so it owes nothing; one cut or disconnected may have left the engine stuck."""
        with self._lock:
            self.inflight -= 1
            if answered:
                self._owed.pop(request_id, None)

    def _owed_stall(self, now: float) -> float | None:
        """Seconds owed with nothing in flight; None when the engine's process beat since the debt
        (plus a period): an idle engine that never got the request (the API server dropped it) is not
        stuck, while a stopped one sends no heartbeat."""
        owed_since = self.owed_since
        if owed_since is None:
            return None
        alive_after = owed_since + beacon.ALIVE_PERIOD_S
        if self.last_alive is not None and self.last_alive > alive_after and not self.engine_busy:
            self._owed.clear()
            return None
        return now - owed_since

    def chunk_sent(self) -> None:
        self.last_chunk = time.monotonic()

    def report(self) -> dict:
        """`stalled_s`: how long the engine has owed progress: with generate requests in flight, since
        the last step, a layer of it, or a response chunk; with none, since a request that came (and was maybe
        aborted) before the engine stepped again, or since a step with tokens last moved; else
        0. So a stuck engine stays stalled after its requests were cut, until it steps again. None
        when this engine never beat (no DisaggConnector), which says nothing either way.
        `recovering_s`: how long the model worker has been rebuilding what a lost attention server
        held (None: it is not); the router moves the instance's requests elsewhere meanwhile."""
        with self._lock:
            now = time.monotonic()
            if not self.num_beats:
                stalled = None
            elif self.inflight:
                stalled = now - max(self.last_beat, self.last_layer, self.last_chunk, self.work_since)
            elif (owed := self._owed_stall(now)) is not None:
                stalled = owed
            elif self.engine_busy:
                stalled = now - max(self.last_beat, self.last_layer)
            else:
                stalled = 0.0
            stalled = None if stalled is None else round(max(0.0, stalled), 3)
            expected = self.expected_step_s()
            progress = self.expected_progress_s(expected)
            limit = stall_limit_for(progress, stall_timeout_s())
            return {"live": stalled is None or stalled <= limit, "stalled_s": stalled,
                    "expected_step_s": None if expected is None else round(expected, 4),
                    "expected_progress_s": None if progress is None else round(progress, 4),
                    "layer_progress": self.step_layer_progress, "num_layers": self.num_layers,
                    "num_step_samples": len(self._steps),
                    "inflight": self.inflight, "engine_busy": self.engine_busy, "num_beats": self.num_beats,
                    "since_beat_s": round(now - self.last_beat, 3) if self.num_beats else None,
                    "recovering_s": self._recovering_s(now)}


def stall_timeout_s() -> float:
    try:
        return float(os.environ.get(ENV_STALL_TIMEOUT, "10"))
    except ValueError:
        return 10.0


_STATE: LiveState | None = None
_STATE_LOCK = threading.Lock()


def live_state() -> LiveState:
    """This API server's state (one per process, bound on first use)."""
    global _STATE
    with _STATE_LOCK:
        if _STATE is None:
            _STATE = LiveState()
        return _STATE


