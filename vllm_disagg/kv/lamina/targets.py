# SPDX-License-Identifier: Apache-2.0
"""Decode side of prefill -> attention-server pushes: a Lamina model worker holds no KV, so the prefill
instance writes straight into the attention servers' blocks (issue 4).

Same connector, side channel and contract as P/D (`push_receiver.py`): D's scheduler allocates block
ids (= the servers' block ids), this receiver registers them with the prefill side, and the request
is reported in finished_recving once every byte landed; a dead or stalled prefill instance makes D
recompute the prompt (kv_load_failure_policy=recompute), written to the servers by the model.

More: README.md, "lamina/targets.py".
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.attention import backend, queries
from vllm_disagg.attention.partition import resolved_section
from vllm_disagg.config import disagg_config_from_vllm
from vllm_disagg.errors import DisaggError
from vllm_disagg.kv.metadata import RecvSpec
from vllm_disagg.kv.push_receiver import PushReceiver, RecvState
from vllm_disagg.kv.register_body import encode_targets
from vllm_disagg.transport import checksum

__all__ = ["AttnPushReceiver", "attention_settings"]

logger = init_logger(__name__)
_POLL_S = 0.002
_POLL_WARN_EVERY_S = 10.0
"""A landing poll that keeps failing (a lost server restarting) is logged once per this long, not 10
times a second (the Lamina chaos run: ~100 identical warnings per lost server)."""


def attention_settings(vllm_config: Any):
    """The `remote_attention` section when this decode worker runs remote attention, else None
    (its partition resolved: "auto" becomes "head" or "request" for this model)."""
    cfg = disagg_config_from_vllm(vllm_config)
    remote_attention = cfg.remote_attention if cfg else None
    if remote_attention is None or not remote_attention.servers:
        return None
    return resolved_section(remote_attention, vllm_config)


class AttnPushReceiver(PushReceiver):
    """PushReceiver whose KV lands on the attention servers `remote_attention.servers` (head- or request-wise)."""

    def __init__(self, control: Any, handshake: Any, token: str, stats: Any, failure_policy: str, remote_attention: Any,
                 placer: Any = None, client: Any = None, verify: bool = False,
                 recompute_slow_pushes: bool = True):
        self.servers, self.partition, self.http_timeout_s = list(remote_attention.servers), remote_attention.partition, min(remote_attention.timeout_s, 5.0)
        self._placer = placer
        self._client_fn = client or backend.current_client
        self._unclaimed: set[str] = set()  # transfer ids whose blocks the servers did not confirm (CLAIM)
        self._kv_addrs: list[str] | None = None
        self._exact_fence = False
        self._kv_addrs_recoveries = 0  # the client's num_recoveries when `_kv_addrs` was asked
        self._where: dict[str, int] = {}  # transfer_id -> server (request-wise)
        self._totals: dict[str, int] = {}  # transfer_id -> bytes landed over all servers
        self._totals_lock = threading.Lock()
        self._fences: set[str] = set()  # failed transfer ids no server lands a byte of any more
        # the attention servers use vLLM's CPU layout; our own tensors are zero-byte `meta` placeholders
        handshake = dataclasses.replace(handshake, kv_layout=handshake.kv_layout.replace("meta:", "cpu:", 1))
        super().__init__(control, None, handshake, token, [], stats, failure_policy, verify=verify,
                         recompute_slow_pushes=recompute_slow_pushes)
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="disagg-kv-attn-landed", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------ PushReceiver hooks
    def _open_receiver(self, data: Any, layers: list[Any]) -> str:
        self._receiver = None
        return "attention:" + ",".join(self.servers)

    def start(self, specs: list[RecvSpec]) -> None:
        if self.partition == "request":  # engine thread: the same thread the placer splits steps on
            for spec in specs:
                self._where[spec.transfer_id] = self._place(spec)
        self._claim(specs)
        super().start(specs)

    def _claim(self, specs: list[RecvSpec]) -> None:
        """CLAIM the specs' blocks on their servers (engine thread, the attention client's thread) before
        they are registered with the prefill side: the servers cannot see where a push writes, so they
        drop those blocks' registrations and move retained KV out of them now (attention/retain.py).
        A spec whose claim failed is never registered (`_register_fields` refuses it): D recomputes."""
        if self.partition == "request":  # an unplaced request fails at registration, with its own reason
            specs = [s for s in specs if self._where.get(s.transfer_id, -1) >= 0]
        if not specs:
            return
        client = self._client_fn()
        ids = [b for spec in specs for b in spec.block_ids]
        owners = [spec.block_ids[0] for spec in specs for _ in spec.block_ids]
        if client is None:
            failed = set(ids)
        else:
            try:
                failed = client.claim(ids, self.http_timeout_s, owners if self.partition == "request" else None)
            except (DisaggError, ValueError) as err:
                logger.warning("claiming %d blocks for prefill pushes failed: %s", len(ids), err)
                failed = set(ids)
        for spec in specs:
            if failed.intersection(spec.block_ids):
                self._unclaimed.add(spec.transfer_id)

    def _place(self, spec: RecvSpec) -> int:
        if self._placer is None:
            client = backend.current_client()
            self._placer = client.placer if client is not None else None
        if self._placer is None or not spec.block_ids or spec.start_block:
            return -1  # registration fails below: D recomputes
        if len(self._where) > 4096:  # finished transfers: oldest first
            for transfer_id in list(self._where)[:2048]:
                del self._where[transfer_id]
        return self._placer.place(spec.block_ids[0], spec.num_prompt_tokens)

    def _register_fields(self, spec: RecvSpec) -> dict:
        if spec.transfer_id in self._unclaimed:
            self._unclaimed.discard(spec.transfer_id)
            raise DisaggError("the attention servers did not confirm the CLAIM of its blocks")
        addrs = self._kv_addresses()
        if self.partition == "head":
            return {"targets": encode_targets([(a, len(addrs), i) for i, a in enumerate(addrs)])}
        server = self._where.get(spec.transfer_id, -1)
        if server < 0:
            raise DisaggError("request-wise push needs the request's whole prompt in fresh blocks and a placer")
        return {"targets": encode_targets([(addrs[server], 1, 0)])}

    def _kv_addresses(self) -> list[str]:
        """Each server's KV receiver address, asked again after a failed push and after the model
        worker's client reconnected to a restarted server: a Ray actor restarts on new ports, and every
        push registered with the old ones failed on P's side while D waited out push_timeout_s."""
        client = self._client_fn()
        recoveries = getattr(client, "num_recoveries", 0) if client is not None else 0
        if self._kv_addrs is None or recoveries != self._kv_addrs_recoveries:
            receivers = [queries.kv_receiver(server, self.http_timeout_s) for server in self.servers]
            self._kv_addrs = [address for address, _ in receivers]
            self._exact_fence = all(kind == "tcp" for _, kind in receivers)  # shm: P copies the bytes itself
            self._kv_addrs_recoveries = recoveries
        return self._kv_addrs

    def _fence_is_exact(self) -> bool:
        """Every server lands the pushes itself (tcp), so its `POST /kv/fence` stops a push's later bytes."""
        return self._exact_fence

    def _drain_notifications(self) -> None:
        with self._totals_lock:
            totals = dict(self._totals)
        with self._lock:
            for transfer_id, landed in totals.items():
                recv = self._by_tid.get(transfer_id)
                if recv is not None and recv.state in (RecvState.REGISTERING, RecvState.REGISTERED):
                    self._landed(recv, landed)

    def _first_bad_layer(self, spec: RecvSpec, remote_text: object) -> int | None:
        """P's checksums per KV-head shard (head-wise) or of whole blocks (request-wise), against what
        each server holds now (`GET /kv/checksums`): the first layer that differs on any server."""
        servers = self._servers_of(spec.transfer_id)
        num_layers = self.handshake.num_layers
        remote = checksum.decode_shards(remote_text, num_layers, len(servers))
        bad = []
        for server, expected in zip(servers, remote, strict=True):
            local = checksum.decode(queries.kv_checksums(server, list(spec.block_ids), self.token, self.http_timeout_s),
                                    num_layers)
            bad.append(checksum.first_difference(local, expected))
        return min((layer for layer in bad if layer is not None), default=None)

    def _servers_of(self, transfer_id: str) -> list[str]:
        """The servers a push writes to, in shard order."""
        if self.partition == "head":
            return list(self.servers)
        server = self._where.get(transfer_id, -1)
        if server < 0:  # pruned or never placed: fail the check (a KeyError would leave it verifying)
            raise DisaggError(f"push {transfer_id} has no attention server on record")
        return [self.servers[server]]

    def _fail_lost_peers(self) -> None:
        """A prefill instance that dies after ACCEPT closes its side channel to us (EOF, or its BYE):
        fail its registered receives now instead of at push_timeout_s (the servers keep no peer list
        for D). A host that vanishes without closing its sockets is still noticed at push_timeout_s."""
        with self._lock:
            remotes = {r.spec.remote for r in self._recvs.values() if r.state is RecvState.REGISTERED}
        lost = {a for a in remotes if self._client.closed_by_peer(a)}
        if not lost:
            return
        with self._lock:
            for recv in self._recvs.values():
                if recv.spec.remote in lost and recv.state is RecvState.REGISTERED:
                    self._set_failed(recv, f"prefill instance {recv.spec.remote} closed its side channel")
        for address in lost:
            self._client.drop(address)

    def _set_failed(self, recv, reason: str) -> None:
        self._kv_addrs = None  # a restarted server listens elsewhere: P's pushes to the old address all fail
        super()._set_failed(recv, reason)

    def _fenced(self, transfer_id: str) -> bool:
        with self._totals_lock:
            return transfer_id in self._fences

    # ------------------------------------------------------------ landing poller
    def _poll_loop(self) -> None:
        warned_at, num_quiet = float("-inf"), 0
        while not self._stop.wait(_POLL_S):
            with self._lock:
                pending = [r.spec.transfer_id for r in self._recvs.values() if r.state is RecvState.REGISTERED]
                failed = [r.spec.transfer_id for r in self._recvs.values() if r.state is RecvState.FAILED]
            with self._totals_lock:
                self._fences &= set(failed)
                failed = [t for t in failed if t not in self._fences]
            if failed:
                self._fence(failed)
            if not pending:
                continue
            try:
                totals = self._landed_totals(pending)
            except DisaggError as err:
                if time.monotonic() - warned_at >= _POLL_WARN_EVERY_S:
                    logger.warning("KV push to attention servers: %s%s", err,
                                   f" (and {num_quiet} more failed polls)" if num_quiet else "")
                    warned_at, num_quiet = time.monotonic(), 0
                else:
                    num_quiet += 1
                self._stop.wait(0.1)
                continue
            with self._totals_lock:
                self._totals = totals

    def _fence(self, transfer_ids: list[str]) -> None:
        """The servers drop every later byte of these failed pushes before vLLM reuses their blocks
        (a slow link can still carry them after the prefill side's CANCEL went unanswered). One call
        per server; where one of its pushes is still mid-landing, all of them are asked again next
        round. A server that does not answer lost its ingest with its process: nothing lands there."""
        fenced = set(transfer_ids)
        for server, mine in self._per_server(transfer_ids):
            try:
                if not queries.fence(server, mine, self.token, self.http_timeout_s):
                    fenced -= set(mine)
            except DisaggError as err:
                logger.info("KV pushes %s: fence on attention server %s: %s", mine, server, err)
        with self._totals_lock:
            self._fences |= fenced

    def _landed_totals(self, transfer_ids: list[str]) -> dict[str, int]:
        """Bytes landed per transfer, summed over the servers that receive it."""
        totals = dict.fromkeys(transfer_ids, 0)
        for server, mine in self._per_server(transfer_ids):
            for transfer_id, num_bytes in queries.landed_bytes(server, mine, self.http_timeout_s).items():
                if transfer_id in totals:
                    totals[transfer_id] += num_bytes
        return totals

    def _per_server(self, transfer_ids: list[str]) -> list[tuple[str, list[str]]]:
        """(server, the pushes of `transfer_ids` that write to it): all of them head-wise, the placed
        ones request-wise; servers with none are left out."""
        out = []
        for i, server in enumerate(self.servers):
            mine = [t for t in transfer_ids if self.partition == "head" or self._where.get(t) == i]
            if mine:
                out.append((server, mine))
        return out

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=1)
        self._shutdown_pools()
        self._client.close()
