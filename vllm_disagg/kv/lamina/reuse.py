# SPDX-License-Identifier: Apache-2.0
"""A restarted model worker reuses the KV its attention servers kept (issue 4, connector side).

The servers keep each model worker's registered full blocks, by content key (`block_keys.py`),
when its session ends, and copy them into new block ids on request (`docs/design/retain_api.md`). This
module is the `DisaggConnector`'s part of that, active only with `remote_attention` configured (its halves: README.md).

More: README.md, "lamina/reuse.py".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_disagg.attention import backend
from vllm_disagg.attention.block_keys import KEY_SIZE, chain_keys, model_salt
from vllm_disagg.attention.queries import fetch_retained
from vllm_disagg.errors import DisaggError

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["DisaggReuseScheduler", "DisaggReuseWorker", "ReuseMeta", "RetainedIndex", "fetch_retained"]

logger = init_logger(__name__)
_RETRY_S = 5.0  # a failed lookup is retried at most this often ...
_RETRY_WINDOW_S = 60.0  # ... and only this long after the first try: reuse matters right after a restart
_PD_MAX_TAIL_BLOCKS = 2  # a P/D request restores instead of waiting for its push if at most this much is left


@dataclass
class ReuseMeta:
    """Scheduler -> worker, per step (in-process, part of `DisaggConnectorMetadata`)."""

    restores: list[tuple[bytes, int]] = field(default_factory=list)
    """(key, block id): copy the retained block `key` into `block id` before the forward."""
    restore_owners: list[int] = field(default_factory=list)
    """First block id of each restore's request (request-wise placement; ignored head-wise)."""
    reg_block_ids: list[int] = field(default_factory=list)
    """Full blocks whose KV is on the servers, to register under `reg_keys` (same order)."""
    reg_keys: list[bytes] = field(default_factory=list)
    reg_owners: list[int] = field(default_factory=list)
    """First block id of each entry's request (the request-wise placer's name for it)."""


class RetainedIndex:
    """The keys the servers kept from the previous model worker, per server.

    Head-wise a block is usable only if every server kept its slice; request-wise a request's chain
    must be on one server (where its blocks lived).

    Fetched once at start (the servers build the set when this worker's sessions INIT, which is
    before the scheduler exists); a failed fetch is retried on later lookups for a minute (each try
    blocks the scheduler for at most the HTTP timeout), and the set is dropped once its TTL has run
    out (a restore would miss anyway)."""

    def __init__(self, servers: Sequence[str], token: str, block_size: int, fetch: Callable = fetch_retained,
                 partition: str = "head"):
        self.servers, self.token, self.block_size, self.partition = list(servers), token, block_size, partition
        self._fetch = fetch
        self.keys: frozenset[bytes] = frozenset()
        """Head-wise: the keys every server kept; request-wise: the keys any server kept."""
        self.per_server: list[frozenset[bytes]] = []
        self._expires = 0.0
        self._retry_at: float | None = 0.0  # None: fetched fine (or gave up), do not ask again
        self._give_up_at: float | None = None

    def refresh(self) -> None:
        now = time.monotonic()
        if self._give_up_at is None:
            self._give_up_at = now + _RETRY_WINDOW_S
        try:
            answers = [self._fetch(s, self.token) for s in self.servers]
        except DisaggError as err:
            self._forget()
            self._retry_at = now + _RETRY_S if now + _RETRY_S < self._give_up_at else None
            logger.warning("retained KV lookup failed (%s); %s", err,
                           "retrying later" if self._retry_at is not None else "no reuse after this restart")
            return
        self._retry_at = None
        wrong = [s for s, a in zip(self.servers, answers) if a["block_size"] != self.block_size]
        if wrong:
            logger.warning("attention servers %s kept blocks of another block size; not reusing them", wrong)
            self._forget()
            return
        self.per_server = [frozenset(a["keys"]) for a in answers]
        combine = frozenset.intersection if self.partition == "head" else frozenset.union
        self.keys = combine(*self.per_server) if answers else frozenset()
        self._expires = now + min(a["ttl_s"] for a in answers) if answers else now
        if self.keys:
            logger.info("attention servers kept %d blocks of the previous model worker (%.0f s left)",
                        len(self.keys), self._expires - now)

    def current(self) -> frozenset[bytes]:
        """The retained keys now (empty once expired); retries a failed fetch when due."""
        now = time.monotonic()
        if self._retry_at is not None and now >= self._retry_at:
            self.refresh()
        if self.keys and now >= self._expires:
            logger.info("the attention servers' retained KV has expired; no more reuse")
            self._forget()
        return self.keys

    def _forget(self) -> None:
        self.keys, self.per_server = frozenset(), []

    def num_matched_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are retained (a chain: the first miss ends the match)."""
        if not self.current():
            return 0
        sets = [self.keys] if self.partition == "head" else self.per_server
        return max(_leading(keys, retained) for retained in sets)


def _leading(keys: Sequence[bytes], retained: frozenset[bytes]) -> int:
    n = 0
    while n < len(keys) and keys[n] in retained:
        n += 1
    return n


# ---------------------------------------------------------------- scheduler half
@dataclass
class _ReqState:
    request: Request
    keys: list[bytes]
    """Chain keys of the request's full blocks computed so far (extended on demand)."""
    num_registered: int
    """Leading blocks already registered on the servers (or restored there, which registers them)."""


class DisaggReuseScheduler:
    """Scheduler half: lookup, restores and per-step registrations (see the module docstring)."""

    def __init__(self, block_size: int, salt: bytes, index: RetainedIndex,
                 kv_cache_manager: Callable[[], KVCacheManager | None], lookup: bool = True):
        self.block_size, self.salt = block_size, salt
        self.index = index
        self.lookup = lookup
        """False: register only, never match (kv_load_failure_policy is not "recompute")."""
        self._kv_cache_manager = kv_cache_manager
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, int] = {}  # req_id -> first block the matched range starts at
        self._restores: list[tuple[bytes, int]] = []
        self._restore_owners: list[int] = []
        self._finished = ReuseMeta()  # registrations of finished requests, for the next step
        self.num_restored_tokens = 0
        """Tokens this scheduler asked the servers to restore instead of computing (failed ones included)."""

    @classmethod
    def from_config(cls, vllm_config: Any, remote_attention: Any, token: str,
                    kv_cache_manager: Callable[[], KVCacheManager | None]) -> DisaggReuseScheduler:
        block_size = vllm_config.cache_config.block_size
        index = RetainedIndex(remote_attention.servers, token, block_size, partition=remote_attention.partition)
        lookup = vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        if lookup:
            index.refresh()
        else:
            logger.warning('retained KV is not reused: it needs kv_load_failure_policy="recompute" (a block '
                           "that expired on a server would fail its request instead of being recomputed)")
        return cls(block_size, model_salt(vllm_config), index, kv_cache_manager, lookup)

    def _keys(self, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        return chain_keys(token_ids[: num_blocks * self.block_size], self.block_size, self.salt)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Retained full-block tokens past `num_computed_tokens` (block-aligned local hit)."""
        self._lookups.pop(request.request_id, None)  # a lookup whose allocation failed is asked again
        if not self.lookup or not self.index.current():
            return 0
        loadable = (request.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        matched = self.index.num_matched_blocks(self._keys(request.all_token_ids, loadable))
        start = num_computed_tokens // self.block_size
        if matched <= start:
            return 0
        self._lookups[request.request_id] = start
        return (matched - start) * self.block_size

    def takes_over_push(self, request: Request, num_computed_tokens: int) -> int:
        """A P/D request (`do_remote_prefill`) whose tokens the servers already hold, as when the router
        replays prompt + generated ids after this model worker restarted: the retained full-block tokens
        to restore instead of waiting for the prefill push (the tail, at most `_PD_MAX_TAIL_BLOCKS`
        blocks, is computed here), or 0 to let the push come (a short or no match: computing most of a
        prompt here would defeat P/D). The prefill side, never registered with, gets a CANCEL for that push
        (`kv.scheduler`), so it frees the push's blocks at once."""
        matched = self.get_num_new_matched_tokens(request, num_computed_tokens)
        if matched and request.num_tokens - num_computed_tokens - matched <= _PD_MAX_TAIL_BLOCKS * self.block_size:
            logger.info("request %s: restoring %d tokens the attention servers kept instead of waiting for its "
                        "prefill push", request.request_id, matched)
            return matched
        self._lookups.pop(request.request_id, None)
        return 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Track the request; with a match, queue its (key, block) restores for this step."""
        start = self._lookups.pop(request.request_id, 0)
        num_loaded = num_external_tokens // self.block_size if num_external_tokens > 0 else 0
        state = _ReqState(request, [], start + num_loaded)
        self._reqs[request.request_id] = state
        if num_loaded == 0:
            return
        (block_ids,) = blocks.get_block_ids()
        self._extend_keys(state, start + num_loaded)
        self._restores += zip(state.keys[start:start + num_loaded], block_ids[start:start + num_loaded],
                              strict=True)
        self._restore_owners += [block_ids[0]] * num_loaded
        self.num_restored_tokens += num_loaded * self.block_size

    def _extend_keys(self, state: _ReqState, num_blocks: int) -> None:
        have = len(state.keys)
        if num_blocks <= have:
            return
        tokens = state.request.all_token_ids[have * self.block_size:num_blocks * self.block_size]
        state.keys += chain_keys(tokens, self.block_size, self.salt, state.keys[-1] if have else bytes(KEY_SIZE))

    def build_meta(self, scheduler_output: SchedulerOutput) -> ReuseMeta:
        meta, self._finished = self._finished, ReuseMeta()
        meta.restores, self._restores = self._restores, []
        meta.restore_owners, self._restore_owners = self._restore_owners, []
        for req_id in scheduler_output.num_scheduled_tokens:
            state = self._reqs.get(req_id)
            if state is not None:
                self._register(req_id, state, meta)
        return meta

    def _register(self, req_id: str, state: _ReqState, meta: ReuseMeta, block_ids: Sequence[int] | None = None):
        """Queue the request's full, written, not yet registered blocks."""
        num_full = state.request.num_computed_tokens // self.block_size
        if num_full < state.num_registered:  # a failed restore cut num_computed_tokens: recomputed later
            state.num_registered = num_full
        if num_full == state.num_registered:
            return
        if block_ids is None:
            manager = self._kv_cache_manager()
            if manager is None:
                return
            (block_ids,) = manager.get_block_ids(req_id)
        num_full = min(num_full, len(block_ids))
        self._extend_keys(state, num_full)
        new = range(state.num_registered, num_full)
        meta.reg_block_ids += [block_ids[i] for i in new]
        meta.reg_keys += state.keys[state.num_registered:num_full]
        meta.reg_owners += [block_ids[0]] * len(new)
        state.num_registered = num_full

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> None:
        """Register the blocks its last steps filled (they ride on the next step's meta frame)."""
        self._lookups.pop(request.request_id, None)
        state = self._reqs.pop(request.request_id, None)
        if state is not None and block_ids:
            self._register(request.request_id, state, self._finished, block_ids)


# ---------------------------------------------------------------- worker half
class DisaggReuseWorker:
    """Worker half: hands registrations and restores to the process's `DisaggAttentionClient`."""

    def __init__(self, timeout_s: float, client: Callable[[], Any] | None = None):
        self.timeout_s = timeout_s
        self._client = client or _runner_client
        self._restores: list[tuple[bytes, int]] = []
        self._restore_owners: list[int] = []
        self._failed: set[int] = set()
        self.num_restored_blocks = 0
        self.num_failed_blocks = 0

    def bind(self, meta: ReuseMeta | None) -> None:
        if meta is None:
            return
        self._restores, self._restore_owners = list(meta.restores), list(meta.restore_owners)
        if meta.reg_block_ids:
            client = self._client()
            if client is not None:
                client.queue_registrations(meta.reg_block_ids, meta.reg_keys, meta.reg_owners)

    def start_load(self) -> None:
        """Restore this step's blocks on the servers (before the forward: vLLM calls start_load_kv
        first when a step has synchronous loads, and only restores make ours synchronous)."""
        pairs, owners = self._restores, self._restore_owners or None
        self._restores, self._restore_owners = [], []
        if not pairs:
            return
        client = self._client()
        try:
            if client is None:
                raise DisaggError("this process has no attention client")
            failed = set(client.restore(pairs, self.timeout_s, owner_first_block=owners)) & {b for _, b in pairs}
        except (DisaggError, ValueError) as err:  # never a wrong block: recompute them all
            logger.warning("restoring %d retained blocks failed (%s); recomputing them", len(pairs), err)
            failed = {b for _, b in pairs}
        if failed:
            logger.info("%d of %d retained blocks could not be restored; recomputing them", len(failed), len(pairs))
        self._failed |= failed
        self.num_restored_blocks += len(pairs) - len(failed)
        self.num_failed_blocks += len(failed)

    def take_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed


def _runner_client() -> Any:
    return backend.current_client()
