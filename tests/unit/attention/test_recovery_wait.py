# SPDX-License-Identifier: Apache-2.0
"""A model worker waiting for its attention servers after a loss asks them all at once and never past
its `replacement_wait_s`, even when a server accepts connections but does not answer yet (starting)."""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm_disagg.attention.recovery import answering


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _silent() -> socket.socket:
    """Listening, never accepting: a connection completes (the backlog), no answer ever comes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def test_servers_are_asked_at_once_and_each_call_ends_at_the_deadline():
    silent = [_silent() for _ in range(3)]
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        addrs = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent] + [f"127.0.0.1:{http.server_port}"]
        t0 = time.monotonic()
        assert answering(addrs, deadline=t0 + 0.4) == addrs[-1:]
        assert time.monotonic() - t0 < 0.9  # one after another with 1 s each: over 3 s
        t0 = time.monotonic()
        assert answering(addrs[:1], deadline=t0 + 5.0) == []
        assert 0.9 < time.monotonic() - t0 < 1.6  # a call still lasts at most 1 s
    finally:
        http.shutdown()
        for s in silent:
            s.close()
