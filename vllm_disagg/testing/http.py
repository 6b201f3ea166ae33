# SPDX-License-Identifier: Apache-2.0
"""One way for the test kit and the benchmarks to ask a server whether it answers: `answers` (a GET
returns 200 within `timeout_s`), `health` (the `/health` body, or None) and `wait_http`. A refused,
reset or timed-out call is "no", never an exception: the callers poll instances that chaos kills."""

from __future__ import annotations

import json
import time
import urllib.request


def answers(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def health(base_url: str, timeout_s: float = 5.0) -> dict | None:
    """The JSON body of `base_url`/health when it answers 200, else None."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"{}") if resp.status == 200 else None
    except (OSError, ValueError):
        return None


def wait_http(url: str, timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers(url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not answering 200 after {timeout_s:.0f} s")
        time.sleep(poll_s)
