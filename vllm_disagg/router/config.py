# SPDX-License-Identifier: Apache-2.0
"""The router's typed settings: pool membership (static flags) and every timeout it waits on.

Membership is static, as in pd_protocol.md: `--prefill URL --prefill-kv HOST:PORT` (paired by order),
`--decode URL`, `--mixed URL`. Timeouts exist so that no client request can hang on a dead instance.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_disagg import envs
from vllm_disagg.config import check_host_port


class RouterConfig(BaseModel):
    """Everything `vllm-disagg router` / `vllm launch disagg-proxy` needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefill_urls: list[str] = Field(default_factory=list)
    """HTTP base URL of each prefill (P) instance, e.g. http://127.0.0.1:8100."""
    prefill_kv: list[str] = Field(default_factory=list)
    """HOST:PORT of each P instance's KV side channel, in the order of `prefill_urls`."""
    decode_urls: list[str] = Field(default_factory=list)
    """HTTP base URL of each decode (D) instance."""
    mixed_urls: list[str] = Field(default_factory=list)
    """Plain instances that serve whole requests (Splitwise's mixed pool, or a single-instance demo)."""
    pd_protocol: Literal["push", "vllm"] = "push"
    """How a request crosses from P to D. `push`: ours (pd_protocol.md), P and D at once, P pushes the KV
    to D's connector (needs `prefill_kv`). `vllm`: vLLM's own connectors (NixlConnector pull or push):
    P first, then D with the `kv_transfer_params` P answered with; no `prefill_kv`."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Opening a connection to an instance; a refused or silent instance fails fast."""
    read_timeout_s: float = Field(300.0, gt=0)
    """Longest silence between two chunks from an instance before the request fails cleanly."""
    idle_keepalive_s: float = Field(3.0, gt=0)
    """How long an idle pooled connection to an instance is reused. It must stay below vLLM's own
    keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a connection reused as uvicorn closes it fails
    the request with ServerDisconnectedError (the one CI failure of stop 23)."""
    prefill_timeout_s: float = Field(300.0, gt=0)
    """Whole P request (prefill + push); past it the router gives up on P (D recomputes)."""
    push_timeout_s: float | None = Field(None, gt=0)
    """Sent to D as `kv_transfer_params.push_timeout_s`; None leaves D's own `kv.push_timeout_s`."""
    auth_token: str | None = Field(default_factory=envs.auth_token, repr=False, exclude=True)
    """The deployment's shared token (default $VLLM_DISAGG_AUTH_TOKEN): signs the CANCEL the router
    sends P for a decode half it gave up on (push_cancel.py); None sends none."""
    health_interval_s: float = Field(2.0, gt=0)
    """Period of the /health poll of every instance."""
    health_timeout_s: float = Field(5.0, gt=0)
    """A /health answer slower than this counts as a failure."""
    health_failures_to_drop: int = Field(2, ge=1)
    """Consecutive failed polls before an instance is dropped from its pool (one success restores it)."""
    retry_on_connect_error: bool = True
    """Re-route once when an instance refuses the connection before any byte reached the client."""
    replay_attempts: int = Field(3, ge=0)
    """Re-sends of a single-prompt request whose instance failed (refused, 5xx, died mid-answer); a
    stream goes on from the tokens already sent (router/replay.py). 0 turns replay off."""
    replay_wait_s: float = Field(300.0, gt=0)
    """Longest wait for a healthy instance before a replay (long enough for a restart); then the
    client gets an error."""
    admission_wait_s: float = Field(120.0, ge=0)
    """Longest wait of a NEW request for a healthy instance when none can take it (the only decode or
    mixed instance is restarting): it is routed as soon as one joins or passes a health check, else
    it gets 503 after this long. 0 answers 503 at once."""
    stall_timeout_s: float = Field(10.0, gt=0)
    """An instance with requests in flight that shows no progress this long (its `/live` reports a stuck
    engine step, or it stops answering) is cut from routing, and its requests are replayed or failed
    over (non-replayable ones, when they cannot be re-sent, end with an error naming the stall). A wait
    the instance expects to take longer gets 3 x its `expected_progress_s` (`liveness.LONG_STEP_MARGIN`:
    its step's time, or one layer's share of it while the step's layers report)."""
    stall_factor: float | None = Field(5.0, gt=1)
    """Adaptive hang detection (None: off, the fixed `stall_timeout_s` only). An instance whose `/live` reports `expected_step_s` (its
    recent steps scaled to the step in progress) is cut after `stall_factor` times that, within
    [`stall_min_s`, `stall_timeout_s`]: a frozen decode engine stepping every 50 ms is cut in seconds,
    a long prefill still gets the full `stall_timeout_s`. A cold engine (no step samples yet) is
    marked suspect only when `/live` does not answer: its first forward, slower than `stall_min_s` on a
    loaded box, marked a healthy instance when it was on by default before (CI, test_lamina_pd)."""
    stall_min_s: float = Field(2.0, gt=0)
    """The shortest adaptive stall limit (scheduling noise on a loaded host stays below it)."""
    stall_release_s: float = Field(0.5, gt=0)
    """With adaptive detection: an instance with requests on it that owes progress past this (and past
    `stall_factor` times its expected step) is suspect. New requests avoid it while another instance
    shows progress, and its requests that have shown the client nothing yet are moved there
    at once; it stays in routing, and is cut only at its stall limit. A false alarm costs those
    requests a re-prefill, not the instance."""
    max_waiting: int = Field(256, ge=0)
    """New requests that may wait for admission at once (no healthy instance); past it a request gets
    503 with Retry-After at once. 0: none waits."""
    api_keys: list[str] = Field(default_factory=list)
    """`--api-key` (else $VLLM_API_KEY), as on `vllm serve`: clients send `Authorization: Bearer KEY` on
    /v1, /v2, /inference and /cohere; the header is passed on to the instances."""
    dynamic_membership: bool = False
    """Pools are filled at run time by a discovery source (Kubernetes, Ray); may start empty."""

    @model_validator(mode="after")
    def _check_membership(self) -> RouterConfig:
        if self.pd_protocol == "vllm" and self.prefill_kv:
            raise ValueError("--prefill-kv is for the push protocol; vLLM's connectors find P's KV themselves")
        if self.pd_protocol == "push" and len(self.prefill_kv) != len(self.prefill_urls):
            raise ValueError(
                f"--prefill-kv given {len(self.prefill_kv)} times for {len(self.prefill_urls)} --prefill; "
                "give one HOST:PORT per prefill instance, in the same order"
            )
        for addr in self.prefill_kv:
            check_host_port(addr)
        if self.dynamic_membership:
            return self  # /health answers 503 until discovery adds a decode or mixed instance
        if self.prefill_urls and not self.decode_urls and not self.mixed_urls:
            raise ValueError("prefill instances need at least one --decode (or --mixed) instance")
        if not (self.decode_urls or self.mixed_urls):
            raise ValueError("no instances: give --decode/--prefill pairs or --mixed URL")
        for url in [*self.prefill_urls, *self.decode_urls, *self.mixed_urls]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL must start with http:// or https://, got {url!r}")
        return self
