# SPDX-License-Identifier: Apache-2.0
"""The model worker's side of remote attention: N server connections and the per-layer exchange.

Lifecycle: `connect(geometry)` finds each server through its `/health` (data address), opens a
`MsgChannel`, sends INIT and learns the capacity (`num_blocks`, the smallest server's). Per layer,
`submit(...)` sends the step's q/k/v slices and returns a `PendingAttention` at once;
`PendingAttention.wait(output)` collects the answers and writes vLLM's output tensor. Several
submissions may be in flight (pipelining); replies come back in order per channel.

More: README.md, "client.py".
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from vllm_disagg import envs
from vllm_disagg.attention import wire
from vllm_disagg.attention.merge import merge_attn_states, partial_attention
from vllm_disagg.attention.partition import RequestPlacer, head_shards, resolve_partition
from vllm_disagg.errors import DisaggError, PeerLostError, ProtocolError, TransportTimeout
from vllm_disagg.logs import init_logger
from vllm_disagg.observe.context import TraceContext
from vllm_disagg.transport import TransportOptions, get_transport

logger = init_logger(__name__)
_META_CACHE = 8  # must match the server's
_meta_ids = itertools.count(1)
_ALL_HEADS = ("heads", None)


class AttentionServerLost(DisaggError):
    """An attention server died, timed out or broke the protocol; its KV is gone."""

    def __init__(self, server: str, cause: Exception):
        self.server = server
        super().__init__(f"attention server {server}: {cause}")


@dataclass
class ClientMeta:
    """One step's batch layout as the backend's builder produced it (CPU tensors)."""

    step: wire.StepMeta
    max_query_len: int
    num_actual_tokens: int = 0
    meta_id: int = field(default_factory=lambda: next(_meta_ids))
    trace: TraceContext | None = None
    """W3C trace context sent with this step's metadata (HAS_TRACE), for the servers' spans."""
    _splits: list | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class ServerConn:
    """One attention server: HTTP address, message channel, sequence numbers."""

    def __init__(self, http_addr: str, transport, timeout_s: float):
        self.http_addr = http_addr
        self.transport = transport
        self.timeout_s = timeout_s
        self.channel = None
        self.info: dict = {}
        self._seq = itertools.count(1)
        self._sent_metas: OrderedDict[int, None] = OrderedDict()
        self._regs: dict[int, bytes] = {}  # block -> key, sent with the next step metadata
        self._regs_lock = threading.Lock()
        self._late: dict[int, int] = {}  # seq -> type of replies given up on (timeout), dropped when they come
        self.num_late_replies = 0

    def queue_registrations(self, pairs) -> None:
        with self._regs_lock:
            self._regs.update(pairs)

    def _take_registrations(self) -> list:
        """The queued registrations as payloads (empty if none); called when metadata goes out."""
        if not self._regs:  # unlocked peek: the common case costs one dict truth test
            return []
        with self._regs_lock:
            regs, self._regs = self._regs, {}
        return wire.encode_block_keys(regs.keys(), regs.values())

    def connect(self, geometry: wire.Geometry, resume: bool = False, trace: TraceContext | None = None) -> dict:
        try:
            with urllib.request.urlopen(f"http://{self.http_addr}/health", timeout=self.timeout_s) as r:
                health = json.loads(r.read())
            self.channel = self.transport.connect_msg(health["address"], timeout=self.timeout_s)
        except (OSError, KeyError, ValueError, DisaggError) as err:
            raise AttentionServerLost(self.http_addr, err) from err
        seq = self.send(wire.INIT, [geometry.to_json(), *wire.encode_trace(trace)],
                        flags=(wire.RESUME if resume else 0) | (wire.HAS_TRACE if trace is not None else 0))
        reply = self.recv(seq, wire.INIT_OK, timeout=max(self.timeout_s, 120.0))  # allocates the KV
        self.info = json.loads(bytes(reply.buffers[0]))
        return self.info

    def send(self, mtype: int, tensors: list, meta: ClientMeta | None = None,
             step: wire.StepMeta | None = None, layer: int = 0, num_tokens: int = 0, scale: float = 0.0,
             flags: int = 0) -> int:
        seq = next(self._seq)
        if meta is not None and meta.meta_id not in self._sent_metas:
            regs = self._take_registrations()
            flags = wire.HAS_META | (wire.HAS_REG if regs else 0) | (wire.HAS_TRACE if meta.trace is not None else 0)
            tensors = [*tensors, *(step or meta.step).tensors(), *regs, *wire.encode_trace(meta.trace)]
            self._sent_metas[meta.meta_id] = None
            while len(self._sent_metas) > _META_CACHE:
                self._sent_metas.popitem(last=False)
        step_meta = step or (meta.step if meta else None)
        h = wire.Header(mtype, seq, flags, layer, meta.meta_id if meta else 0, num_tokens,
                        step_meta.num_reqs if step_meta else 0, step_meta.block_table.shape[1] if step_meta else 0, scale)
        try:
            self.channel.send(h.pack(), [wire.byte_view(t) if isinstance(t, torch.Tensor) else t for t in tensors],
                              timeout=self.timeout_s)
        except DisaggError as err:
            raise AttentionServerLost(self.http_addr, err) from err
        return seq

    def recv(self, seq: int, mtype: int, timeout: float | None = None, out: list | None = None):
        """The reply to `seq`; `out` (optional) receives its payloads in place (checked by size).

        A reply that did not come in time is remembered (`_late`): when it does arrive, ahead of the
        replies sent after it, it is read and dropped here, so a slow CLAIM or RESTORE never answers
        the next call in its place."""
        while True:
            try:
                msg = self.channel.recv(out, timeout=timeout or self.timeout_s)
                h = wire.unpack_header(msg.header)
            except TransportTimeout as err:
                self._late[seq] = mtype
                raise AttentionServerLost(self.http_addr, err) from err
            except (PeerLostError, ProtocolError, ValueError) as err:  # ValueError: out too small
                raise AttentionServerLost(self.http_addr, err) from err
            if self._late.pop(h.seq, None) is None or h.seq == seq:
                break
            logger.info("attention server %s: dropped the late %s reply to seq %d", self.http_addr, h.mtype.name,
                        h.seq)
            self.num_late_replies += 1
        if h.mtype == wire.ERROR:
            self._sent_metas.clear()  # the server may have dropped what we think it holds
            raise AttentionServerLost(self.http_addr, ProtocolError(wire.error_text(msg.buffers)))
        if h.mtype != mtype or h.seq != seq:
            raise AttentionServerLost(self.http_addr, ProtocolError(
                f"expected {wire.TYPE_NAMES[mtype]} seq {seq}, got {wire.TYPE_NAMES[h.mtype]} seq {h.seq}"))
        return msg

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class DisaggAttentionClient:
    """Remote attention over `servers` (HTTP addresses), head- or request-partitioned."""

    def __init__(self, servers: list[str], transport: str = "shm", partition: str = "auto",
                 send_q_early: bool = False, timeout_s: float = 30.0, auth_token: str | None = None,
                 spin_us: float | None = None):
        if not servers:
            raise ValueError('remote_attention.servers is empty: list the attention servers\' HOST:PORT')
        token = auth_token or envs.auth_token()
        if not token:
            raise ValueError("remote attention needs a shared token: set VLLM_DISAGG_AUTH_TOKEN")
        spin = {} if spin_us is None else {"spin_us": spin_us}  # None: the transport's default
        self.transport = get_transport(transport, TransportOptions(auth_token=token, timeout_s=timeout_s, **spin))
        self.configured = list(servers)
        self.timeout_s = timeout_s
        self.conns = [ServerConn(s, self.transport, timeout_s) for s in servers]
        self.geometry_args: dict = {}
        self.num_recoveries = 0
        self.partition = partition  # "auto" is resolved by connect(), which learns the KV heads
        self.send_q_early = self.want_send_q_early = send_q_early
        self.num_blocks = 0
        self.shards = None
        self.placer = RequestPlacer(len(servers)) if partition == "request" else None

    def connect(self, num_layers: int, num_heads: int, num_kv_heads: int, head_size: int,
                block_size: int, dtype: str, max_num_tokens: int, trace: TraceContext | None = None,
                kv_cache_dtype: str = "auto", layers: tuple = ()) -> int:
        """Connect and INIT every server (with `trace`, if given); returns the usable number of blocks.
        `layers`: one `variants.LayerAttrs` per layer (window, soft-cap, ALiBi, sinks, fp8 scales),
        empty = plain; head-wise each server gets its query heads' slice of the per-head values."""
        self.geometry_args = dict(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_size=head_size, block_size=block_size, dtype=dtype,
                                  max_num_tokens=max_num_tokens, kv_cache_dtype=kv_cache_dtype,
                                  layers=tuple(layers))
        n = len(self.conns)
        if self.partition == "auto":
            self.partition = resolve_partition("auto", n, num_kv_heads)
            self.placer = RequestPlacer(n) if self.partition == "request" else None
        if self.partition == "head":
            self.shards = head_shards(n, num_heads, num_kv_heads)
            geoms = [wire.Geometry(num_layers, s.num_heads, s.num_kv_heads, head_size, block_size, dtype,
                                   max_num_tokens, kv_cache_dtype, tuple(a.for_heads(s.q_heads) for a in layers))
                     for s in self.shards]
        else:
            geoms = [wire.Geometry(num_layers, num_heads, num_kv_heads, head_size, block_size, dtype,
                                   max_num_tokens, kv_cache_dtype, tuple(layers))] * n
        resume = self.num_blocks > 0  # connected before: the recovery reconnects, not a restart
        infos = [c.connect(g, resume, trace) for c, g in zip(self.conns, geoms)]
        self.num_blocks = min(int(i["num_blocks"]) for i in infos)
        lse = all(i.get("supports_lse") for i in infos)
        if self.send_q_early and not lse:
            logger.warning("attention servers cannot return the LSE; send-Q-early is off")
        self.send_q_early = self.want_send_q_early and lse
        logger.info("remote attention: %d servers (%s), %d blocks, send_q_early=%s",
                    n, self.partition, self.num_blocks, self.send_q_early)
        return self.num_blocks

    def close(self) -> None:
        for c in self.conns:
            c.close()

    # ---- KV retention across a model-worker restart (retain.py) ------------------------------
    def queue_registrations(self, block_ids, keys, owner_first_block) -> None:
        """Block `block_ids[i]` holds the token chain `keys[i]` (16 bytes) and was written by an
        earlier step. Thread-safe, no round trip: rides on the next step-metadata frame. Head-wise
        every server holds the block; request-wise only the server of the request whose block
        table starts with `owner_first_block[i]` (entries of unplaced requests are dropped)."""
        if not len(block_ids) == len(keys) == len(owner_first_block):
            raise ValueError(f"{len(block_ids)} block ids, {len(keys)} keys, {len(owner_first_block)} owners")
        self._check_block_keys(block_ids, keys)
        if self.placer is None:
            pairs = list(zip(block_ids, keys))
            for conn in self.conns:
                conn.queue_registrations(pairs)
            return
        per_server: dict[int, list] = {}
        for b, k, first in zip(block_ids, keys, owner_first_block):
            server = self.placer.server_of(first)  # the server of a placed request (or cached chain)
            if server is not None:
                per_server.setdefault(server, []).append((b, k))
        for server, pairs in per_server.items():
            self.conns[server].queue_registrations(pairs)

    def _check_block_keys(self, block_ids, keys) -> None:
        for b, k in zip(block_ids, keys):
            if not isinstance(k, bytes) or len(k) != wire.KEY_BYTES:
                raise ValueError(f"block key must be {wire.KEY_BYTES} bytes, got {k!r}")
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} outside the servers' [0, {self.num_blocks})")

    def restore(self, pairs, timeout_s: float, owner_first_block=None) -> set[int]:
        """Copy the retained block of key `k` into block `b` for each `(k, b)` of `pairs` (distinct
        `b`), ordered before this step's layer frames. Returns the block ids not restored (missing,
        expired, or the server is lost: the caller recomputes them; a lost server is then found by
        the step itself). Head-wise every server must restore a block. Request-wise, pass
        `owner_first_block[i]` (the first block of pair i's request, pairs in chain order): each
        request goes to the server that restored the longest prefix of its blocks, and the rest of
        its blocks count as failed (ValueError without owners)."""
        pairs = list(pairs)
        all_ids = {b for _, b in pairs}
        if not pairs:
            return set()
        if len(all_ids) != len(pairs):
            raise ValueError("restore: a block id appears twice")
        self._check_block_keys([b for _, b in pairs], [k for k, _ in pairs])
        if self.placer is None:
            return set().union(*self._restore_each(pairs, timeout_s)) & all_ids
        if owner_first_block is None or len(owner_first_block) != len(pairs):
            # without owners no request could be placed, and its step would then fail in the placer
            raise ValueError("request-wise restore needs owner_first_block, one per pair")
        return self._restore_request_wise(pairs, list(owner_first_block), timeout_s)

    def _restore_each(self, pairs: list, timeout_s: float) -> list[set[int]]:
        """RESTORE on every server; the failed block ids of each (all of them if it is lost)."""
        all_ids = {b for _, b in pairs}
        payload = wire.encode_block_keys([b for _, b in pairs], [k for k, _ in pairs])
        sent = []
        for conn in self.conns:
            # queued registrations describe blocks as they were BEFORE this step's restores (a
            # finished request's block may be a restore target now): the server applies them first
            regs = conn._take_registrations()
            try:
                sent.append((conn, conn.send(wire.RESTORE, payload + regs, flags=wire.HAS_REG if regs else 0)))
            except AttentionServerLost as err:
                logger.warning("restore of %d blocks: %s", len(pairs), err)
                sent.append((conn, None))
        # every reply is read, so no channel is left holding one
        return [all_ids if seq is None else self._restore_reply(conn, seq, timeout_s, all_ids) for conn, seq in sent]

    def claim(self, block_ids, timeout_s: float, owner_first_block=None) -> set[int]:
        """A prefill instance is about to push KV into `block_ids` (kv_ingest.py): each server that
        holds them drops their registrations and moves retained data out of them, and has answered
        when this returns, so only then may the push be registered with the prefill side. Head-wise
        every server; request-wise the server the request of `owner_first_block[i]` is placed on.
        Returns the block ids not claimed (server lost, ERROR, timeout, or request not placed): the
        caller must not let a push land in them (it recomputes instead)."""
        block_ids = [int(b) for b in block_ids]
        if not block_ids:
            return set()
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("claim: a block id appears twice")
        self._check_block_keys(block_ids, [bytes(wire.KEY_BYTES)] * len(block_ids))
        if self.placer is None:
            per_server = {i: block_ids for i in range(len(self.conns))}
            failed: set[int] = set()
        else:
            if owner_first_block is None or len(owner_first_block) != len(block_ids):
                raise ValueError("request-wise claim needs owner_first_block, one per block id")
            per_server, failed = {}, set()
            for b, first in zip(block_ids, owner_first_block):
                server = self.placer.server_of(first)
                if server is None:
                    failed.add(b)
                else:
                    per_server.setdefault(server, []).append(b)
        sent = []
        for server, ids in per_server.items():
            conn = self.conns[server]
            regs = conn._take_registrations()  # they describe the blocks before this claim: applied first
            try:
                payload = [torch.tensor(ids, dtype=torch.int32), *regs]
                sent.append((conn, ids, conn.send(wire.CLAIM, payload, flags=wire.HAS_REG if regs else 0)))
            except AttentionServerLost as err:
                logger.warning("claim of %d blocks: %s", len(ids), err)
                failed.update(ids)
        for conn, ids, seq in sent:  # every reply is read, so no channel is left holding one
            try:
                conn.recv(seq, wire.CLAIM_OK, timeout=timeout_s)
            except AttentionServerLost as err:
                logger.warning("claim of %d blocks: %s", len(ids), err)
                failed.update(ids)
        return failed

    def _restore_request_wise(self, pairs: list, owners: list[int], timeout_s: float) -> set[int]:
        per_server = self._restore_each(pairs, timeout_s)
        groups: dict[int, list[int]] = {}  # request (its first block) -> its blocks in chain order
        for (_, b), first in zip(pairs, owners):
            groups.setdefault(first, []).append(b)
        failed: set[int] = set()
        block_size = self.geometry_args["block_size"]
        for first, blocks in groups.items():
            prefix = [next((i for i, b in enumerate(blocks) if b in miss), len(blocks)) for miss in per_server]
            best = max(range(len(per_server)), key=lambda s: (prefix[s], -s))
            # placed even with nothing restored: the step runs it as a continuing request (vLLM discards
            # and recomputes what failed), and the placer must know its server (its entry, partition.py)
            self.placer._set(first, best, len(blocks) * block_size)
            failed.update(blocks[prefix[best]:])
        return failed

    @staticmethod
    def _restore_reply(conn: ServerConn, seq: int, timeout_s: float, all_ids: set[int]) -> set[int]:
        try:
            msg = conn.recv(seq, wire.RESTORE_OK, timeout=timeout_s)
            if len(msg.buffers) != 1:
                raise ProtocolError(f"RESTORE_OK carries 1 payload, got {len(msg.buffers)}")
            nbytes = msg.buffers[0].nbytes
            return set(wire.as_tensor(msg.buffers[0], torch.int32, (nbytes // 4,), "failed block ids").tolist())
        except (AttentionServerLost, ProtocolError) as err:
            logger.warning("restore of %d blocks: %s", len(all_ids), err)
            return all_ids

    def attend(self, layer: int, q, k, v, meta: ClientMeta, scale: float, output) -> None:
        self.submit(layer, q, k, v, meta, scale).wait(output)

    def submit(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ClientMeta,
               scale: float) -> PendingAttention:
        """Send one layer's attention; q [T, H, D], k/v [T, Hkv, D] (T = actual tokens)."""
        early = self.send_q_early and meta.decode_only
        parts = self._head_parts(q, k, v) if self.placer is None else self._request_parts(q, k, v, meta)
        pend = PendingAttention(self, layer, q.shape, q.dtype, early)
        for conn, sel, (qs, ks, vs), step in parts:
            ntok = qs.shape[0]
            if ntok == 0:
                continue
            if early:
                seq = conn.send(wire.QPREV, [qs], meta, step, layer, ntok, scale)
                conn.send(wire.KV, [ks, vs], meta, step, layer, ntok)
            else:
                seq = conn.send(wire.ATTN, [qs, ks, vs], meta, step, layer, ntok, scale)
            pend.expect.append((conn, seq, sel))
        if early:  # the new token's own term, computed while the servers work on the past
            pend.new = partial_attention(q, k[:, None], v[:, None], scale)
        return pend

    def _head_parts(self, q, k, v):
        if len(self.shards) == 1:  # one server holds every head: no slicing (the common local case)
            return [(self.conns[0], _ALL_HEADS, (q.contiguous(), k.contiguous(), v.contiguous()), None)]
        out = []
        for conn, s in zip(self.conns, self.shards):
            qkv = (q[:, s.q_heads].contiguous(), k[:, s.kv_heads].contiguous(), v[:, s.kv_heads].contiguous())
            out.append((conn, ("heads", s.q_heads), qkv, None))
        return out

    def _request_parts(self, q, k, v, meta: ClientMeta):
        if meta._splits is None:
            meta._splits = self.placer.split(meta.step)
        out = []
        for sp in meta._splits:
            ids = sp.token_ids
            qkv = (q.index_select(0, ids), k.index_select(0, ids), v.index_select(0, ids))
            out.append((self.conns[sp.server], ("tokens", ids), qkv, sp.meta))
        return out


class PendingAttention:
    """One layer's attention in flight; `wait(output)` fills vLLM's output [T, H, D]."""

    def __init__(self, client: DisaggAttentionClient, layer: int, shape, dtype, early: bool):
        self.client = client
        self.layer = layer
        self.shape = shape
        self.dtype = dtype
        self.early = early
        self.expect: list = []
        self.new = None

    def wait(self, output: torch.Tensor) -> torch.Tensor:
        t, h, d = self.shape
        if self.early:
            prev = torch.zeros(t, h, d, dtype=self.dtype)
            lse = torch.full((t, h), float("-inf"))
        if not self.early and len(self.expect) == 1 and self.expect[0][2][1] is None and output.is_contiguous():
            conn, seq, _ = self.expect[0]  # one server, all heads: its reply lands in `output` itself
            msg = conn.recv(seq, wire.OUT, out=[output])
            if len(msg.buffers) != 1 or msg.buffers[0].nbytes != output.nbytes:
                raise AttentionServerLost(conn.http_addr, ProtocolError(
                    f"OUT of {[b.nbytes for b in msg.buffers]} bytes, expected {output.nbytes}"))
            return output
        for conn, seq, (kind, sel) in self.expect:
            msg = conn.recv(seq, wire.OUT_LSE if self.early else wire.OUT)
            if sel is None:
                sel = slice(0, h)
            n = sel.shape[0] if kind == "tokens" else t
            hs = h if kind == "tokens" else sel.stop - sel.start
            part = wire.as_tensor(msg.buffers[0], self.dtype, (n, hs, d), "attention output")
            target = prev if self.early else output
            if kind == "tokens":
                target.index_copy_(0, sel, part)
            else:
                target[:, sel].copy_(part)
            if self.early:
                part_lse = wire.as_tensor(msg.buffers[1], torch.float32, (n, hs), "lse")
                if kind == "tokens":
                    lse.index_copy_(0, sel, part_lse)
                else:
                    lse[:, sel].copy_(part_lse)
        if self.early:
            merged, _ = merge_attn_states(prev, lse, *self.new)
            output.copy_(merged)
        return output
