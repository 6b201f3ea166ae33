# SPDX-License-Identifier: Apache-2.0
"""Decode side of the KV push (runs in the decode worker): registration and landing.

Lifecycle of one receive (`_Recv`, keyed by transfer_id): README.md.

More: README.md, "push_receiver.py".
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm_disagg.errors import DisaggError, HandshakeMismatch
from vllm_disagg.kv.handshake import (
    HandshakeInfo,
    MsgType,
    SideMsg,
    cancel_msg,
    check_compatible,
    decode_msg,
    encode_msg,
    handshake_body,
    parse_groups,
)
from vllm_disagg.kv.metadata import CancelSpec, RecvSpec
from vllm_disagg.kv.push_status import SLOW_AFTER_S, RecvState, StatusRounds
from vllm_disagg.kv.register_body import encode_more_groups
from vllm_disagg.kv.side_channel import SideChannelClient
from vllm_disagg.kv.spans import end_receive_span, start_receive_span
from vllm_disagg.kv.stats import StatsSink
from vllm_disagg.observe import tracing
from vllm_disagg.transport import KVReceiver, Transport, checksum

__all__ = ["PushReceiver", "RecvState"]

logger = init_logger(__name__)
_THREADS_PER_PREFILL = 2
"""Calls to one prefill instance share one channel and its lock, so more threads would only queue there."""
POOL_IDLE_S = 300.0
"""A prefill instance nothing was sent to for this long loses its threads and side channel here (an
autoscaled prefill pool leaves a new address behind with every pod it replaces)."""


_OVER = (RecvState.DONE, RecvState.FAILED)
_WAITING = (RecvState.REGISTERING, RecvState.REGISTERED)


@dataclass
class _Recv:
    spec: RecvSpec
    expected_bytes: int
    deadline: float
    landed_bytes: int = 0
    state: RecvState = RecvState.REGISTERING
    error: str | None = None
    fatal: bool = False
    announced: bool = False
    span: Any = None
    """`kv.receive` of a traced request (kv/spans.py), ended when the receive is over."""
    t_progress: float = field(default_factory=time.monotonic)
    """When a byte last landed (or the prefill side last said the push goes on)."""
    t_created: float = field(default_factory=time.monotonic)
    ask_at: float = field(default_factory=lambda: time.monotonic() + SLOW_AFTER_S)
    """When the slow-link rule next asks the prefill side about it (kv/push_status.py)."""
    probing: bool = False
    num_unknown: int = 0
    last_heard: str = "nothing yet (registering)"
    """What the prefill side last said of the push (registration, STATUS), named when it times out."""


class PushReceiver(StatusRounds):
    """Owns the decode worker's KV receiver (on `data`) and side-channel client (on `control`)."""

    def __init__(self, control: Transport, data: Transport | None, handshake: HandshakeInfo, token: str,
                 layers: list[Any], stats: StatsSink, failure_policy: str = "recompute",
                 advertise_address: str | None = None, verify: bool = False, recompute_slow_pushes: bool = True):
        self.handshake, self.token, self.layers = handshake, token, layers
        self.layer_groups = parse_groups(handshake.kv_groups, handshake.num_layers)
        """The KV cache group of each layer: which of a RecvSpec's block tables its blocks land in."""
        self.verify = verify
        """Check every push end to end before its request runs (checksum.py)."""
        self._on_failure = ("the decode instance recomputes the prompt" if failure_policy == "recompute"
                            else "the request fails (kv_load_failure_policy=fail)")
        self._stats, self._stats_lock = stats
        listening = self._open_receiver(data, layers)
        self.address = advertise_address or listening
        """What REGISTER tells the prefill side to connect to (`kv.advertise_address`, else where we listen)."""
        self._client = SideChannelClient(lambda addr, timeout: control.connect_msg(addr, timeout=timeout))
        self._pools: dict[str, ThreadPoolExecutor] = {}  # per prefill address: see _submit
        self._pool_used: dict[str, float] = {}  # per prefill address: when a call was last submitted
        self._pools_lock = threading.Lock()  # its own: _submit is called holding self._lock too
        self._lock = threading.Lock()
        self._recvs: dict[str, _Recv] = {}  # req_id -> receive
        self._by_tid: dict[str, _Recv] = {}
        self._late: dict[str, float] = {}  # transfer ids given up on; their notifications are dropped
        self._init_status(recompute_slow_pushes)
        self._errors: dict[str, tuple[str, bool]] = {}
        self.num_landed = 0
        """Receives whose every byte landed (the evidence, per TP rank, that pushes arrive here)."""
        logger.info("KV push receiver listening on %s%s", listening,
                    "" if self.address == listening else f", advertised as {self.address}")

    def _open_receiver(self, data: Transport | None, layers: list[Any]) -> str:
        """This worker's KV receiver, one region per layer (`kv.lamina.targets` lands KV elsewhere)."""
        self._receiver: KVReceiver = data.kv_receiver(name="decode")
        for layer_idx, tensor in enumerate(layers):
            self._receiver.register_region(str(layer_idx), tensor)
        return self._receiver.start()

    def _register_fields(self, spec: RecvSpec) -> dict:
        """More REGISTER body fields (`targets` for attention servers); may raise DisaggError."""
        return {}

    # ------------------------------------------------------------ engine thread
    def start(self, specs: list[RecvSpec]) -> None:
        for spec in specs:
            expected = sum(map(len, self._layer_block_ids(spec))) * self.handshake.block_nbytes
            recv = _Recv(spec, expected, time.monotonic() + spec.push_timeout_s,
                         span=start_receive_span(spec, expected) if spec.trace is not None else None)
            with self._lock:
                self._recvs[spec.req_id] = recv
                if spec.transfer_id in self._by_tid or spec.transfer_id in self._late:
                    self._set_failed(recv, f"transfer_id {spec.transfer_id} is already in use by another request")
                    continue
                self._by_tid[spec.transfer_id] = recv
            self._submit(spec.remote, self._register, recv)

    def _layer_block_ids(self, spec: RecvSpec) -> list[tuple[int, ...]]:
        """Each layer's registered blocks: its KV cache group's."""
        groups = spec.groups()
        return [groups[g][1] for g in self.layer_groups]

    def cancel(self, specs: list[CancelSpec]) -> None:
        """CANCEL pushes the scheduler gave up on (aborted while waiting, or taken over from the
        attention servers), on pool threads: the prefill side frees their blocks at once."""
        for spec in specs:
            with self._lock:
                recv = self._recvs.get(spec.req_id)
                if recv is not None and recv.spec.transfer_id == spec.transfer_id and recv.state in _WAITING:
                    recv.state = RecvState.CANCELLING
                elif recv is not None:
                    continue  # already over (or cancelling): nothing left to stop
            if recv is not None:
                self._submit(spec.remote, self._cancel, recv, spec.reason)
            else:
                self._submit(spec.remote, self._send_cancel, spec.remote, spec.transfer_id, spec.reason)

    def _submit(self, remote: str, fn: Any, *args: Any) -> None:
        """Calls to one prefill instance run on threads of its own: calls to a frozen one wait out their
        timeouts (10 s a REGISTER), and on one shared pool they held up every other prefill instance's
        registrations behind them (the 2P+2D chaos soak: requests via a live P waited 15 s)."""
        now = time.monotonic()
        with self._pools_lock:
            idle = [a for a, t in self._pool_used.items() if now - t > POOL_IDLE_S and a != remote]
            retired = [self._retire(address) for address in idle]
            pool = self._pools.get(remote)
            if pool is None:
                pool = self._pools[remote] = ThreadPoolExecutor(max_workers=_THREADS_PER_PREFILL,
                                                                thread_name_prefix="disagg-kv-register")
            self._pool_used[remote] = now
        pool.submit(fn, *args)
        for address, old in zip(idle, retired, strict=True):
            old.shutdown(wait=False)  # its threads end once idle (a call still queued runs first)
            self._client.drop(address)

    def _retire(self, address: str) -> ThreadPoolExecutor:
        """Forget an idle prefill instance's pool (holding `_pools_lock`); the caller shuts it down."""
        del self._pool_used[address]
        return self._pools.pop(address)

    def _shutdown_pools(self) -> None:
        with self._pools_lock:
            pools, self._pools, self._pool_used = list(self._pools.values()), {}, {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)

    def poll(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call; failed ones are in both.

        A fatal failure (handshake mismatch) is first announced through `take_errors()` and
        reported here one poll later, so the scheduler knows why before it sees the failure."""
        self._drain_notifications()
        self._fail_lost_peers()
        self._expire(time.monotonic())
        self._probe_waiting(time.monotonic())
        done, failed = set(), set()
        with self._lock:
            for req_id, recv in list(self._recvs.items()):
                if recv.state is RecvState.FAILED and not recv.announced:
                    recv.announced = True
                    self._errors[recv.spec.req_id] = (recv.error or "", recv.fatal)
                    if recv.fatal:
                        continue
                if recv.state in _OVER:
                    if recv.state is RecvState.FAILED and not self._fenced(recv.spec.transfer_id):
                        continue  # one of its writes is still landing: report it (blocks freed) once done
                    del self._recvs[req_id]
                    (done if recv.state is RecvState.DONE else failed).add(req_id)
                    if recv.span is not None:
                        end_receive_span(recv.span, recv.landed_bytes, recv.error)
                    if self._by_tid.get(recv.spec.transfer_id) is recv:
                        del self._by_tid[recv.spec.transfer_id]
                        if recv.state is RecvState.FAILED:
                            self._late[recv.spec.transfer_id] = time.monotonic()
        if failed:
            self._record(lambda s: [s.record_fallback() for _ in failed])
        return done | failed, failed

    def _fence_is_exact(self) -> bool:
        """Whether a failed receive's blocks are safe once `_fenced`, without P's CANCEL_ACK."""
        return self._receiver is not None and self._receiver.exact_fence

    def _fenced(self, transfer_id: str) -> bool:
        """No byte of `transfer_id` lands here from now on (no own receiver: the KV lands elsewhere)."""
        return self._receiver is None or self._receiver.fence(transfer_id)

    def take_errors(self) -> dict[str, tuple[str, bool]]:
        """req_id -> (reason, fatal) for failures announced since the last call."""
        with self._lock:
            errors, self._errors = self._errors, {}
        return errors

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._recvs)

    def _drain_notifications(self) -> None:
        for note in self._receiver.poll_notifications():
            with self._lock:
                recv = self._by_tid.get(note.transfer_id)
                if recv is None or recv.state in (RecvState.FAILED, RecvState.CANCELLING):
                    if note.transfer_id not in self._late:
                        logger.warning("KV push: notification for unknown transfer %s", note.transfer_id)
                    continue
                self._landed(recv, recv.landed_bytes + note.nbytes)

    def _landed(self, recv: _Recv, landed_bytes: int) -> None:
        """Called holding the lock: `landed_bytes` of a waiting receive are in; all of them ends it
        (after P's checksums when verifying)."""
        if landed_bytes > recv.landed_bytes:
            recv.landed_bytes, recv.t_progress = landed_bytes, time.monotonic()
        if recv.landed_bytes < recv.expected_bytes or recv.state not in _WAITING:
            return
        if self.verify:
            recv.state = RecvState.VERIFYING
            self._submit(recv.spec.remote, self._verify, recv)
        else:
            recv.state = RecvState.DONE
            self.num_landed += 1

    def _fail_lost_peers(self) -> None:
        lost = set(self._receiver.lost_peers())
        if not lost:
            return
        with self._lock:
            for recv in self._recvs.values():
                if recv.spec.remote in lost and recv.state not in _OVER:
                    self._set_failed(recv, f"prefill instance {recv.spec.remote} lost mid-transfer")

    def _expire(self, now: float) -> None:
        with self._lock:
            expired = [r for r in self._recvs.values() if now > r.deadline and r.state in _WAITING]
            for recv in expired:
                recv.state = RecvState.CANCELLING
        for recv in expired:
            logger.warning("KV push %s (request %s): nothing complete after %.1fs (%d of %d bytes landed; "
                           "the prefill side last said: %s); cancelling", recv.spec.transfer_id, recv.spec.req_id,
                           recv.spec.push_timeout_s, recv.landed_bytes, recv.expected_bytes, recv.last_heard)
            self._submit(recv.spec.remote, self._cancel, recv)
        for transfer_id, t in list(self._late.items()):
            if now - t > 600:
                del self._late[transfer_id]

    # ------------------------------------------------------------ registration threads
    def _register(self, recv: _Recv) -> None:
        spec = recv.spec
        if recv.state is not RecvState.REGISTERING:  # cancelled (aborted) before its turn came
            return
        body = handshake_body(self.handshake, self.token, spec.transfer_id)
        body.update(address=self.address, start_block=spec.start_block, push_timeout_s=spec.push_timeout_s,
                    num_prompt_tokens=spec.num_prompt_tokens, prompt_digest=spec.prompt_digest)
        if spec.more_groups:
            body["more_groups"] = encode_more_groups(spec.more_groups)
        if self.verify:
            body["verify"] = True
        try:
            body.update(self._register_fields(spec))
            reply = decode_msg(
                self._client.call(spec.remote,
                                  encode_msg(SideMsg(MsgType.REGISTER, body,
                                                     sum((ids for _, ids in spec.groups()), ()),
                                                     tracing.to_wire(recv.span) or spec.trace)),
                                  timeout=min(spec.push_timeout_s, 10.0)),
                spec.remote,
            )
            self._on_reply(recv, reply)
        except HandshakeMismatch as err:  # our check of the prefill side's ACCEPT
            self._log_refused(recv, str(err))
            recv.fatal = True
            self._cancel(recv, reason=str(err))
        except (DisaggError, OSError) as err:
            with self._lock:
                self._set_failed(recv, f"cannot register with prefill instance {spec.remote}: {err}")

    def _verify(self, recv: _Recv) -> None:
        """Compare P's per-layer checksums with the landed blocks': any difference, or no answer, fails
        the push (the request recomputes its prompt), since the blocks cannot be trusted."""
        spec = recv.spec
        try:
            reply = decode_msg(self._client.call(
                spec.remote, encode_msg(SideMsg(MsgType.VERIFY, {"transfer_id": spec.transfer_id})),
                timeout=min(spec.push_timeout_s, 10.0)), spec.remote)
            if reply.type is not MsgType.CHECKSUMS or reply.transfer_id != spec.transfer_id:
                raise DisaggError(str(reply.body.get("message") or f"prefill answered VERIFY with {reply.type.name}"))
            layer = self._first_bad_layer(spec, reply.body.get("crc32"))
        except (DisaggError, OSError, ValueError) as err:
            with self._lock:
                self._set_failed(recv, f"cannot verify the push with prefill instance {spec.remote}: {err}")
            return
        if layer is not None:
            self._record(lambda s: s.record_checksum_mismatch())
        with self._lock:
            if layer is not None:
                self._set_failed(recv, f"KV checksum mismatch in layer {layer}: the landed blocks differ from "
                                       "the prefill instance's")
            elif recv.state is RecvState.VERIFYING:
                recv.state = RecvState.DONE
                self.num_landed += 1

    def _first_bad_layer(self, spec: RecvSpec, remote_text: object) -> int | None:
        """The first layer whose landed blocks differ from P's checksums (`CHECKSUMS`' crc32), or None;
        ValueError when the text is not this push's checksums."""
        remote = checksum.decode(remote_text, self.handshake.num_layers)
        return checksum.first_difference(checksum.layer_checksums(self.layers, self._layer_block_ids(spec)), remote)

    def _on_reply(self, recv: _Recv, reply: SideMsg) -> None:
        if reply.transfer_id != recv.spec.transfer_id:
            raise HandshakeMismatch("transfer_id", recv.spec.transfer_id, reply.transfer_id, recv.spec.remote)
        if reply.type is MsgType.REJECT:
            message = str(reply.body.get("message", "refused by the prefill instance"))
            self._log_refused(recv, message)
            with self._lock:
                recv.fatal = True
                self._set_failed(recv, message)
            return
        if reply.type is not MsgType.ACCEPT:
            raise HandshakeMismatch("reply type", "ACCEPT", reply.type.name, recv.spec.remote)
        check_compatible(self.handshake, reply.body, self.token, recv.spec.transfer_id, recv.spec.remote)
        with self._lock:
            recv.last_heard = "ACCEPT (registered)"
            if recv.state is RecvState.REGISTERING:
                recv.state = RecvState.REGISTERED
        if recv.span is not None:
            recv.span.add_event("registered", {"disagg.prefill": recv.spec.remote})

    def _log_refused(self, recv: _Recv, message: str) -> None:
        logger.error("KV push %s (request %s) refused by the handshake: %s",
                     recv.spec.transfer_id, recv.spec.req_id, message)
        self._record(lambda s: s.record_handshake_failure())

    def _cancel(self, recv: _Recv, reason: str | None = None) -> None:
        """Ask the prefill side to stop; it answers once none of its writes is in flight."""
        reason = reason or f"push did not complete within {recv.spec.push_timeout_s}s"
        self._send_cancel(recv.spec.remote, recv.spec.transfer_id, reason)
        with self._lock:
            self._set_failed(recv, reason)

    def _send_cancel(self, remote: str, transfer_id: str, reason: str, fenced: bool = False) -> bool:
        try:
            reply = decode_msg(self._client.call(
                remote, cancel_msg(transfer_id, reason, fenced=fenced), timeout=self.call_timeout_s), remote)
            if reply.type is MsgType.CANCEL_ACK:
                return True
            logger.info("KV push %s: prefill answered CANCEL with %s", transfer_id, reply.type.name)
        except (DisaggError, OSError) as err:
            logger.info("KV push %s: cancel not acknowledged (%s); treating the prefill side as gone", transfer_id, err)
        return False

    def _set_failed(self, recv: _Recv, reason: str) -> None:
        if recv.state in _OVER:
            return
        recv.state, recv.error = RecvState.FAILED, reason
        logger.warning("KV push %s (request %s) failed: %s; %s",
                       recv.spec.transfer_id, recv.spec.req_id, reason, self._on_failure)

    def _record(self, fn: Any) -> None:
        with self._stats_lock:
            fn(self._stats)

    def close(self) -> None:
        self._shutdown_pools()
        self._client.close()
        self._receiver.close()
