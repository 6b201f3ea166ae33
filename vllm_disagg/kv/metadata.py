# SPDX-License-Identifier: Apache-2.0
"""What the scheduler half tells the worker half each step (in-process, never on the network).

`DisaggConnectorMetadata` is built once per engine step by `DisaggConnectorScheduler` and bound to
the worker before the forward pass (fields: README.md).

More: README.md, "metadata.py".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_disagg.observe.context import TraceContext

__all__ = ["CancelSpec", "RecvSpec", "SaveSpec", "DisaggConnectorMetadata", "DisaggWorkerMetadata"]


@dataclass(frozen=True)
class RecvSpec:
    """Decode side: register these local blocks with the prefill side channel at `remote`."""

    req_id: str
    transfer_id: str
    remote: str
    """HOST:PORT of the prefill instance's KV side channel."""
    block_ids: tuple[int, ...]
    """Local block ids for prompt blocks `start_block ..`, in order."""
    start_block: int
    """Index (in the request's block table) of `block_ids[0]`; earlier blocks are cached locally."""
    num_prompt_tokens: int
    push_timeout_s: float
    prompt_digest: str = ""
    """Digest of the prompt token ids; the prefill side refuses to push a different prompt."""
    trace: TraceContext | None = None
    """The request's W3C trace context (from its `traceparent`), sent on REGISTER."""
    more_groups: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """(start_block, block_ids) of KV cache groups 1.. under vLLM's hybrid allocator (a model's
    sliding-window layers hold blocks of their own); `block_ids`/`start_block` are group 0's."""

    def groups(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return ((self.start_block, self.block_ids), *self.more_groups)


@dataclass(frozen=True)
class CancelSpec:
    """Decode side: tell the prefill side channel at `remote` to drop push `transfer_id` now."""

    req_id: str
    transfer_id: str
    remote: str
    reason: str


@dataclass(frozen=True)
class SaveSpec:
    """Prefill side: one request's state for this step."""

    req_id: str
    new_block_ids: tuple[int, ...]
    """Blocks allocated this step (all blocks for a new request)."""
    num_computed_tokens: int
    """Prompt tokens whose KV is written after this step's forward pass."""
    num_prompt_tokens: int
    transfer_id: str | None = None
    """Set the first time the worker sees the request."""
    replace_blocks: bool = False
    """True when `new_block_ids` replaces the block table (resumed after preemption)."""
    prompt_digest: str = ""
    trace: TraceContext | None = None
    """With `transfer_id`: the prefill.compute span, parent of the push span unless D's registration names one."""
    more_new_block_ids: tuple[tuple[int, ...], ...] = ()
    """`new_block_ids` of KV cache groups 1.. (vLLM's hybrid allocator); `new_block_ids` is group 0's."""

    def groups(self) -> tuple[tuple[int, ...], ...]:
        return (self.new_block_ids, *self.more_new_block_ids)


@dataclass
class DisaggConnectorMetadata(KVConnectorMetadata):
    recv_specs: list[RecvSpec] = field(default_factory=list)
    save_specs: list[SaveSpec] = field(default_factory=list)
    release_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    cancel_specs: list[CancelSpec] = field(default_factory=list)
    abandoned_req_ids: list[str] = field(default_factory=list)
    """Prefill side: requests aborted before their push ended (the router dropped the attempt)."""
    reuse: Any = None
    """Lamina model worker: `kv.lamina.reuse.ReuseMeta` (restores and block registrations), else None."""
    step_trace: TraceContext | None = None
    """Lamina model worker: the traced request whose attention calls this step are sampled (kv/spans.py)."""


@dataclass
class DisaggWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: why a decode request's push failed (req_id -> reason).

    `fatal` holds the requests whose failure is a configuration error (handshake mismatch); they are
    announced here one step before they appear in failed_recving, so a scheduler-side policy can
    fail them instead of recomputing (see DisaggConnectorScheduler.is_fatal_load_failure)."""

    errors: dict[str, str] = field(default_factory=dict)
    fatal: set[str] = field(default_factory=set)
    attention_recoveries: int = 0
    """How often this worker's remote attention lost a server and reconnected (attention/recovery.py):
    the KV of vLLM's cached, not running, blocks was partly on that server, so the scheduler forgets
    them (DisaggConnectorScheduler.update_connector_output)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> DisaggWorkerMetadata:
        if isinstance(other, DisaggWorkerMetadata):
            self.errors.update(other.errors)
            self.fatal |= other.fatal
            self.attention_recoveries = max(self.attention_recoveries, other.attention_recoveries)
        return self
