# SPDX-License-Identifier: Apache-2.0
"""The chaos campaign's clients: the `openai` client in bounded loops (the stated exception to "no
hand-written load generators": these clients must check tokens and leave mid-stream).

A request is retried the way an OpenAI client user retries: the client library itself retries
connection errors, 408/409/429/5xx and honours `Retry-After` (`max_retries`); a stream cut after it
started (a router restart) is sent again whole by the loop here, at most `MAX_ATTEMPTS` times.
Outcomes: ok (tokens equal the reference), wrong (tokens differ), lost (no answer after every
attempt, or an error the client cannot retry), left (the client disconnected on purpose; the
tokens it saw are checked as a prefix).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_disagg.testing.chaos.workload import ChaosRequest

MAX_ATTEMPTS = 4
"""Whole re-sends of one request after a failure the client library did not retry itself."""
ATTEMPT_TIMEOUT_S = 180.0


@dataclass
class Outcome:
    key: str
    form: str
    stream: bool
    t_sent: float
    """Monotonic time of the first send (the campaign's clock)."""
    outcome: str = "lost"
    ttft_s: float | None = None
    latency_s: float | None = None
    max_gap_s: float = 0.0
    """Longest time without a token after the first one (a retried stream's gap included)."""
    num_attempts: int = 0
    num_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    routes: list[str] = field(default_factory=list)
    last_token_at: float | None = None


class ChaosClients:
    """Sends `requests` at their arrival times from `num_workers` threads, each with its own client."""

    def __init__(self, base_url: str, model: str, references: dict[str, list[int]], num_workers: int = 4,
                 max_retries: int = 8, clock=time.monotonic) -> None:
        import openai

        self.references, self.clock = references, clock
        self.model = model
        self._local = threading.local()
        self._make = lambda: openai.OpenAI(base_url=f"{base_url}/v1", api_key="chaos", max_retries=max_retries,
                                           timeout=ATTEMPT_TIMEOUT_S)
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="chaos-client")
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def run(self, requests: list[ChaosRequest], t0: float, until: float) -> list[Outcome]:
        """Send every request whose arrival (offset from `t0`) falls before `until`; wait for them all."""
        futures = []
        for req in requests:
            at = t0 + req.arrival_s
            if at >= until or self._stop.is_set():
                break
            while (wait_s := at - self.clock()) > 0 and not self._stop.is_set():
                time.sleep(min(0.05, wait_s))  # one clock read: a second one could pass `at` (negative sleep)
            futures.append(self._pool.submit(self._one, req))
        for fut in futures:
            fut.result()
        return self.outcomes

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ one request
    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._make()
        return client

    def _one(self, req: ChaosRequest) -> None:
        out = Outcome(req.key, req.form, req.stream, self.clock())
        want = self.references.get(req.key)
        for _ in range(MAX_ATTEMPTS):
            out.num_attempts += 1
            try:
                ids = self._attempt(req, out)
            except Exception as err:  # noqa: BLE001 (every failure is an outcome to record)
                out.errors.append(f"{type(err).__name__}: {str(err)[:300]}")
                continue
            out.latency_s = self.clock() - out.t_sent
            out.num_tokens = len(ids)
            if req.disconnect_after is not None:
                out.outcome = "left" if want is None or ids == want[:len(ids)] else "wrong"
            else:
                out.outcome = "ok" if ids == want else "wrong"
                if out.outcome == "wrong":
                    out.errors.append(f"tokens {ids[:12]}... differ from the reference {(want or [])[:12]}...")
            break
        with self._lock:
            self.outcomes.append(out)

    def _attempt(self, req: ChaosRequest, out: Outcome) -> list[int]:
        client = self._client()
        extra = {"ignore_eos": True, "return_token_ids": True}
        common = dict(model=self.model, max_tokens=req.max_tokens, temperature=0, stream=req.stream, extra_body=extra)
        if req.form == "completions":
            call = client.completions.with_raw_response.create if not req.stream else client.completions.create
            resp = call(prompt=list(req.prompt_ids), **common)
        else:
            call = client.chat.completions.with_raw_response.create if not req.stream else client.chat.completions.create
            resp = call(messages=[{"role": "user", "content": req.chat_text}], **common)
        if not req.stream:
            out.routes.append(resp.headers.get("x-disagg-route", "?"))
            body = resp.parse()
            ids = list(getattr(body.choices[0], "token_ids", None) or [])
            out.ttft_s = out.ttft_s if out.ttft_s is not None else self.clock() - out.t_sent
            return ids
        ids: list[int] = []
        try:
            for chunk in resp:
                if not chunk.choices:
                    continue
                new = list(getattr(chunk.choices[0], "token_ids", None) or [])
                if not new:
                    continue
                now = self.clock()
                if out.ttft_s is None:
                    out.ttft_s = now - out.t_sent
                if out.last_token_at is not None:
                    out.max_gap_s = max(out.max_gap_s, now - out.last_token_at)
                out.last_token_at = now
                ids += new
                if req.disconnect_after is not None and len(ids) >= req.disconnect_after:
                    break  # the client leaves: closing the response aborts it upstream
        finally:
            resp.close()
        return ids
