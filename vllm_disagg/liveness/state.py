# SPDX-License-Identifier: Apache-2.0
"""Engine progress of one vLLM instance (the stuck-step watchdog), exported on `GET /live`.

vLLM's `/health` only sees an engine that died: a SIGSTOPped EngineCore or one stuck inside a step
passes it. Here EngineCore says "a step started" on every schedule (`StepBeacon.beat`, called by
DisaggConnector's scheduler half) with one datagram to an abstract unix socket (no file, gone with the
process), and the API server (`vllm serve --middleware vllm_disagg.liveness.LiveMiddleware`) answers
`GET /live` with how long the instance has had work (generate requests in flight, or a scheduled step)
without progress (a step, or a response chunk). `/health` turns 503 past `VLLM_DISAGG_STALL_TIMEOUT_S`
(default 10); the router cuts an instance whose `stalled_s` passes its `--stall-timeout-s` and replays
its requests (router/README.md). Imported by `kv/scheduler.py` (the beacon) and, through `--middleware`,
vLLM's API server (named by `launch/local.py` and the k8s manifests). Stdlib only (base layer).

The middleware also refuses (413) a request body past `VLLM_DISAGG_MAX_BODY_MB` (default 64, the
router's own limit) before reading it: vLLM buffers any body and parses it on the event loop that
answers `/live`, so an 80 MB one stalled `/live` past the router's probe and marked a healthy instance
suspect (the chaos soak's huge-body fault).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque

__all__ = ["LONG_STEP_MARGIN", "LiveMiddleware", "LiveState", "StepBeacon", "socket_name", "stall_limit_for"]

logger = logging.getLogger(__name__)
_BEAT = struct.Struct("<iI")  # sender pid, tokens scheduled this step
_ALIVE = struct.Struct("<i")  # sender pid: EngineCore's process runs (heartbeat thread), nothing about steps
ALIVE_PERIOD_S = 1.0
_STATE_LOCK = threading.Lock()
_HEARTBEATS: set[str] = set()
_MIN_BEAT_GAP_S = 0.05  # busy engines step every few ms: one datagram per 50 ms is plenty
ENV_SOCKET = "VLLM_DISAGG_LIVE_SOCKET"
ENV_STALL_TIMEOUT = "VLLM_DISAGG_STALL_TIMEOUT_S"
ENV_MAX_BODY_MB = "VLLM_DISAGG_MAX_BODY_MB"
MAX_BODY_BYTES = 64 << 20
"""The largest request body an instance (and the router) reads; a 128k-token prompt is ~1 MB of JSON."""
_NUM_STEP_SAMPLES = 64
MIN_STEP_SAMPLES = 3
"""Busy steps seen before `expected_step_s` is reported. Each sample over-states its step (beats are at
most one per 50 ms), so a few are safe; 8 left a restarted engine on the fixed limit for minutes at
low load (a short request gives 1-3 samples), and the chaos soak's 7.7 s SIGSTOP of it went uncut."""


LONG_STEP_MARGIN = 3.0
"""A step expected to take E seconds counts as stalled only past this many times E, the fixed timeout
notwithstanding: a 1920-token prompt is one prefill step of ~12-15 s in float32 on one AVX2 core, and
the router cut that healthy prefill instance at 10 s and recomputed the prompt on decode (stop 38).
E scales the engine's fastest recent step linearly to the step's tokens, which under-states a long
prompt's attention: hence a margin, not E itself."""


def stall_limit_for(expected_step_s: object, timeout_s: float) -> float:
    """The fixed stall timeout, raised for a step expected to be long (`LONG_STEP_MARGIN`)."""
    if not isinstance(expected_step_s, (int, float)) or expected_step_s <= 0:
        return timeout_s
    return max(timeout_s, LONG_STEP_MARGIN * float(expected_step_s))


def socket_name(api_server_pid: int) -> str:
    """The abstract socket of the API server `api_server_pid` (EngineCore is its child)."""
    return os.environ.get(ENV_SOCKET) or f"vllm-disagg-live-{api_server_pid}"


class StepBeacon:
    """EngineCore side: best effort, never blocks, never raises (no listener: offline `LLM()`)."""

    def __init__(self, name: str | None = None) -> None:
        self._addr = "\0" + (name or socket_name(os.getppid()))
        self._sock: socket.socket | None = None
        self._last = 0.0
        self._last_busy = False
        self._last_tokens = 0
        self._pid = os.getpid()

    def beat(self, num_scheduled_tokens: int) -> None:
        """A step of `num_scheduled_tokens` starts. Skipped within 50 ms of the last beat unless the
        engine went idle or busy, or the step is over twice the last beat's size: the API server
        scales its expected step time by the last beat's tokens, and must not think a big prefill
        is a small decode step."""
        now = time.monotonic()
        busy = num_scheduled_tokens > 0
        if (now - self._last < _MIN_BEAT_GAP_S and busy == self._last_busy
                and num_scheduled_tokens <= 2 * self._last_tokens):
            return
        self._last, self._last_busy, self._last_tokens = now, busy, num_scheduled_tokens
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            self._sock.sendto(_BEAT.pack(self._pid, max(0, min(num_scheduled_tokens, 2**32 - 1))), self._addr)
        except OSError:  # nobody listening, or its queue is full: the next beat tries again
            pass

    def start_heartbeat(self, period_s: float = ALIVE_PERIOD_S) -> None:
        """Say every `period_s` that this process runs (a daemon thread): an idle engine takes no
        steps, and the API server needs to tell it from a stopped one (`LiveState.report`). Once per
        process and API server: every connector built here shares the thread."""
        with _STATE_LOCK:
            if self._addr in _HEARTBEATS:
                return
            _HEARTBEATS.add(self._addr)

        def run() -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            while True:
                try:
                    sock.sendto(_ALIVE.pack(self._pid), self._addr)
                except OSError:
                    pass
                time.sleep(period_s)

        threading.Thread(target=run, name="disagg-live-heartbeat", daemon=True).start()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


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
            if len(data) == _ALIVE.size:
                self.last_alive = time.monotonic()
            elif len(data) == _BEAT.size:  # only EngineCore writes here (abstract sockets: same user)
                self.beat(_BEAT.unpack(data)[1], time.monotonic())

    def beat(self, num_tokens: int, now: float) -> None:
        """EngineCore started a step of `num_tokens` tokens (0: it has nothing to do) at `now`."""
        with self._lock:
            if self.num_beats and self.engine_busy:
                self._steps.append((now - self.last_beat, self.num_step_tokens))
            self.num_beats += 1
            self.last_beat = now
            self.engine_busy = num_tokens > 0
            self.num_step_tokens = num_tokens
            self._owed.clear()

    def expected_step_s(self) -> float | None:
        """How long the step in progress should take, judged by this engine's recent steps: the most
        optimistic of them scaled up to its token count (a step of more tokens than a sample is
        assumed proportionally slower, never faster). None before `MIN_STEP_SAMPLES` busy steps.
        The router's adaptive stall limit is a multiple of it (router/README.md, "Hang detection")."""
        if len(self._steps) < MIN_STEP_SAMPLES:
            return None
        num_tokens = max(1, self.num_step_tokens)
        return min(gap * max(1.0, num_tokens / max(1, tokens)) for gap, tokens in self._steps)

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
        if self.last_alive is not None and self.last_alive > owed_since + ALIVE_PERIOD_S and not self.engine_busy:
            self._owed.clear()
            return None
        return now - owed_since

    def chunk_sent(self) -> None:
        self.last_chunk = time.monotonic()

    def report(self) -> dict:
        """`stalled_s`: how long the engine has owed progress: with generate requests in flight, since
        the last step (or response chunk); with none, since a request that came (and was maybe
        aborted) before the engine stepped again, or since a step with tokens that never ended; else
        0. So a stuck engine stays stalled after its requests were cut, until it steps again. None
        when this engine never beat (no DisaggConnector), which says nothing either way."""
        with self._lock:
            now = time.monotonic()
            if not self.num_beats:
                stalled = None
            elif self.inflight:
                stalled = now - max(self.last_beat, self.last_chunk, self.work_since)
            elif (owed := self._owed_stall(now)) is not None:
                stalled = owed
            elif self.engine_busy:
                stalled = now - self.last_beat
            else:
                stalled = 0.0
            stalled = None if stalled is None else round(max(0.0, stalled), 3)
            expected = self.expected_step_s()
            limit = stall_limit_for(expected, stall_timeout_s())
            return {"live": stalled is None or stalled <= limit, "stalled_s": stalled,
                    "expected_step_s": None if expected is None else round(expected, 4),
                    "num_step_samples": len(self._steps),
                    "inflight": self.inflight, "engine_busy": self.engine_busy, "num_beats": self.num_beats,
                    "since_beat_s": round(now - self.last_beat, 3) if self.num_beats else None}


def stall_timeout_s() -> float:
    try:
        return float(os.environ.get(ENV_STALL_TIMEOUT, "10"))
    except ValueError:
        return 10.0


_STATE: LiveState | None = None


def live_state() -> LiveState:
    """This API server's state (one per process, bound on first use)."""
    global _STATE
    with _STATE_LOCK:
        if _STATE is None:
            _STATE = LiveState()
        return _STATE


class LiveMiddleware:
    """ASGI middleware for vLLM's API server: `GET /live`, `/health` 503 while stalled, and the body cap
    that keeps `/live` answering (module docstring)."""

    def __init__(self, app) -> None:
        self.app = app
        self.state = live_state()
        self.max_body_bytes = max_body_bytes()

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            return await _respond(send, 413, _too_large(self.max_body_bytes))
        if length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            receive = _CappedReceive(receive, send, self.max_body_bytes)
            try:
                await self._route(scope, receive, receive.send)
            except Exception:
                if not receive.over:  # the app's own failure; past the cap it is the "client gone" we faked
                    raise
            return await receive.refuse_if_over()
        return await self._route(scope, receive, send)

    async def _route(self, scope, receive, send):
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == "/live" and method == "GET":
            report = self.state.report()
            return await _respond(send, 200 if report["live"] else 503, report)
        if path == "/health":
            report = self.state.report()
            if not report["live"]:
                return await _respond(send, 503, {"error": f"engine made no progress for {report['stalled_s']:.1f} s "
                                                           "with work pending", **report})
            return await self.app(scope, receive, send)
        if method != "POST" or not path.startswith("/v1/"):
            return await self.app(scope, receive, send)
        state, answered, gone, request_id, status = self.state, False, False, None, 200

        async def counting_receive():
            nonlocal request_id, gone
            message = await receive()
            if request_id is None and message.get("type") == "http.request" and not message.get("more_body"):
                request_id = state.request_started()  # owed from the body's end: a slow upload is not a stall
            gone = gone or message.get("type") == "http.disconnect"
            return message

        async def counting_send(message):
            nonlocal answered, status
            if message.get("type") == "http.response.start":
                status = int(message.get("status", 200))
            elif message.get("type") == "http.response.body":
                if message.get("body") and status < 400 and not gone:
                    state.chunk_sent()  # an error (an abort's reply to a client that left) is no engine progress
                # after the client left, the server drops what is sent: an abort's error reply is no answer
                answered = answered or (not gone and not message.get("more_body", False))
            await send(message)

        try:
            return await self.app(scope, counting_receive, counting_send)
        finally:
            if request_id is not None:
                state.request_ended(request_id, answered)


def max_body_bytes() -> int:
    """`VLLM_DISAGG_MAX_BODY_MB` in bytes (default MAX_BODY_BYTES); a bad value stops the start."""
    raw = os.environ.get(ENV_MAX_BODY_MB, "").strip()
    if not raw:
        return MAX_BODY_BYTES
    try:
        mib = float(raw)
    except ValueError:
        mib = 0.0
    if mib <= 0:
        raise ValueError(f"{ENV_MAX_BODY_MB}={raw!r}: expected a positive number of MiB")
    return int(mib * (1 << 20))


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length itself
    return None


def _too_large(limit: int) -> dict:
    message = (f"request body larger than {limit / (1 << 20):g} MiB ({ENV_MAX_BODY_MB}); nothing of it was "
               "processed")
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 413}}


class _CappedReceive:
    """A body sent without Content-Length (chunked): once past the limit the app sees the client leave,
    and the client gets the 413 (unless the app answered first)."""

    def __init__(self, receive, send, limit: int) -> None:
        self._receive, self._send, self.limit = receive, send, limit
        self.num_bytes, self.over, self.started = 0, False, False

    async def __call__(self):
        if self.over:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message.get("type") == "http.request":
            self.num_bytes += len(message.get("body", b""))
            if self.num_bytes > self.limit:
                self.over = True
                return {"type": "http.disconnect"}
        return message

    async def send(self, message) -> None:
        if self.over and not self.started:
            return  # the app's answer to a client it thinks left: the 413 goes out instead
        self.started = self.started or message.get("type") == "http.response.start"
        await self._send(message)

    async def refuse_if_over(self) -> None:
        if self.over and not self.started:
            await _respond(self._send, 413, _too_large(self.limit))


async def _respond(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
