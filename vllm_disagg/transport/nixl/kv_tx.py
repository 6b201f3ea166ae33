# SPDX-License-Identifier: Apache-2.0
"""The sending half of the NIXL KV push: one control connection per receiver (hello = our agent
name), one WRITE xfer per `write_blocks` call with a descriptor per run of consecutive blocks and
notif (seq, layer, nbytes, transfer_id); several may be in flight. The protocol: nixl/__init__.py."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_disagg.errors import DisaggError, PeerLostError, TransportTimeout
from vllm_disagg.transport.base import (
    BlockWrite,
    KVPeer,
    KVSender,
    TransportOptions,
    TransportStats,
    XferHandle,
)
from vllm_disagg.transport.kv_common import joint_runs
from vllm_disagg.transport.nixl.agent import (
    KV_SERVICE,
    Poller,
    block_descs,
    make_agent,
    mem_type,
    pack_bye,
    pack_notif,
    park_agent,
    parse_regions,
    release_agent,
    tensor_region,
)
from vllm_disagg.transport.wire import (
    MAX_TID_BYTES,
    T_BYE,
    SockStream,
    client_handshake,
    connect_socket,
    pack_frame,
)

logger = logging.getLogger(__name__)


class NixlKVPeer(KVPeer):
    def __init__(self, sender: NixlKVSender, address: str, stream: SockStream, remote: str, infos, addrs):
        self.address, self.regions = address, {r.name: r for r in infos}
        self._sender, self._stream, self._remote = sender, stream, remote
        self._index = {r.name: (i, r, addrs[i]) for i, r in enumerate(infos)}
        self._seq = 0
        self.error: DisaggError | None = None
        self._closed = False

    def write_blocks(self, writes: Sequence[BlockWrite], transfer_id: str, layer: int = -1) -> XferHandle:
        transfer_id_bytes = transfer_id.encode()
        if len(transfer_id_bytes) > MAX_TID_BYTES:
            raise ValueError(f"transfer_id longer than {MAX_TID_BYTES} bytes")
        plans = [self._plan(w) for w in writes]
        nbytes = sum(p[-1] for p in plans)
        handle = XferHandle(nbytes, self._sender.stats)
        if self._closed:
            raise RuntimeError(f"KV peer {self.address} is closed")
        if self.error is not None:
            handle._finish(self.error)
            return handle
        with self._sender._lock:
            seq, self._seq = self._seq, self._seq + 1
            self._sender._jobs.put((self, handle, plans, pack_notif(seq, layer, nbytes, transfer_id_bytes)))
        return handle

    def _plan(self, w: BlockWrite) -> tuple:
        if w.region not in self._index:
            raise ValueError(f"unknown region {w.region!r}; the peer registered {sorted(self._index)[:8]}...")
        _, info, (dst_base, dst_dev) = self._index[w.region]
        src_info, src_base, src_dev = tensor_region("src", w.src)
        if src_info.block_nbytes != info.block_nbytes:
            raise ValueError(
                f"region {w.region!r}: source block {src_info.block_nbytes} B, peer's {info.block_nbytes} B"
            )
        src_ids = np.asarray(w.src_block_ids, dtype=np.int64).reshape(-1)
        dst_ids = np.asarray(w.dst_block_ids, dtype=np.int64).reshape(-1)
        if len(src_ids) != len(dst_ids):
            raise ValueError(
                f"region {w.region!r}: {len(src_ids)} source ids but {len(dst_ids)} destination ids"
            )
        if len(src_ids) and not (
            0 <= src_ids.min()
            and src_ids.max() < src_info.num_blocks
            and 0 <= dst_ids.min()
            and dst_ids.max() < info.num_blocks
        ):
            raise ValueError(f"region {w.region!r}: block id out of range")
        jr = joint_runs(src_ids, dst_ids)
        bn = info.block_nbytes
        local = block_descs(src_base, bn, [r[0] for r in jr], [r[2] for r in jr], src_dev)
        remote = block_descs(dst_base, bn, [r[1] for r in jr], [r[2] for r in jr], dst_dev)
        return w.src, mem_type(w.src), local, remote, len(src_ids) * bn

    def _fail(self, err: DisaggError) -> None:
        if self.error is None:
            self.error = err
            logger.info("nixl KV peer %s failed: %s", self.address, err)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender._drain(self)
        if self.error is None:
            try:
                # The count lets the receiver wait for notifications still behind the BYE.
                self._stream.send_parts([pack_frame(T_BYE, pack_bye(self._seq))], timeout=1.0)
            except DisaggError:
                pass
        self._stream.close()


class NixlKVSender(KVSender):
    """One NIXL agent and one worker thread (the agent is driven from that thread only)."""

    def __init__(self, options: TransportOptions, name: str):
        self.options, self.name = options, name
        self.stats = TransportStats()
        self._agent, self._agent_name = make_agent("kv-tx", self.options.host)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._registered: dict[tuple[int, int], Any] = {}
        self._peers: list[NixlKVPeer] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="disagg-nixl-tx", daemon=True)
        self._thread.start()

    def connect(self, address: str, timeout: float | None = None) -> KVPeer:
        timeout = self.options.timeout_s if timeout is None else timeout
        stream = SockStream(connect_socket(address, timeout), address, timeout)
        try:
            hello = f"{self._agent_name}\n{self.name}".encode()
            infos, addrs, metadata = parse_regions(
                client_handshake(stream, self.options.auth_token.encode(), KV_SERVICE, hello), address
            )
            done = threading.Event()
            result: list = []
            self._jobs.put(("add_remote", metadata, result, done))
            if not done.wait(timeout) or isinstance(result[0], Exception):
                raise PeerLostError(f"nixl could not load the agent metadata of {address}: {result[:1]}")
        except BaseException:
            stream.close()
            raise
        peer = NixlKVPeer(self, address, stream, result[0], infos, addrs)
        self._peers.append(peer)
        return peer

    def _drain(self, peer: NixlKVPeer) -> None:
        done = threading.Event()
        self._jobs.put(("drain", peer, None, done))
        done.wait(self.options.timeout_s)

    def _run(self) -> None:
        inflight: deque = deque()  # (peer, handle, xfer handle, deadline)
        poller = Poller(self.options.spin_us * 1e-6)
        next_check = 0.0
        while True:
            try:
                job = self._jobs.get(timeout=0 if inflight else 0.2)
            except queue.Empty:
                job = None
            if time.monotonic() > next_check:
                self._check_peers()
                next_check = time.monotonic() + 0.05
            if job is None and not inflight:
                continue
            if job == "stop":
                return
            if job is not None:
                poller.active()
                self._handle_job(job, inflight)
            if inflight and not self._progress(inflight):
                poller.pause()

    def _handle_job(self, job: tuple, inflight: deque) -> None:
        if job[0] == "add_remote":
            _, metadata, result, done = job
            try:
                result.append(self._agent.add_remote_agent(metadata))
            except Exception as err:  # nixl raises its own types
                result.append(err)
            done.set()
        elif job[0] == "drain":
            _, peer, _, done = job
            deadline = time.monotonic() + self.options.timeout_s
            while any(p is peer for p, *_ in inflight) and time.monotonic() < deadline:
                self._progress(inflight)
            done.set()
        else:
            self._submit(*job, inflight)

    def _submit(
        self, peer: NixlKVPeer, handle: XferHandle, plans: list, notif: bytes, inflight: deque
    ) -> None:
        if peer.error is not None:
            handle._finish(peer.error)
            return
        try:
            if not any(len(p[2]) for p in plans):  # nothing to write: the notification alone
                self._agent.send_notif(peer._remote, notif)
                handle._finish()
                return
            for src, *_ in plans:
                self._register(src)
            mtype = plans[0][1]
            if any(p[1] != mtype for p in plans):
                raise ValueError("one write_blocks call cannot mix CPU and GPU sources")
            # One transfer for all pieces, so the single notification follows all of their data.
            ld = self._agent.get_xfer_descs(np.concatenate([p[2] for p in plans]), mtype)
            rd = self._agent.get_xfer_descs(np.concatenate([p[3] for p in plans]), mtype)
            xh = self._agent.initialize_xfer("WRITE", ld, rd, peer._remote, notif)
            xfers = [xh]
            if self._agent.transfer(xh) == "ERR":
                raise PeerLostError(f"nixl WRITE to {peer.address} failed to start")
        except (DisaggError, ValueError) as err:
            err = err if isinstance(err, DisaggError) else PeerLostError(f"nixl WRITE rejected: {err}")
            peer._fail(err)
            handle._finish(err)
            return
        except Exception as err:  # nixl's own exception types
            err = PeerLostError(f"nixl WRITE to {peer.address} failed: {err}")
            peer._fail(err)
            handle._finish(err)
            return
        inflight.append((peer, handle, xfers, time.monotonic() + self.options.timeout_s))

    def _register(self, src: Any) -> None:
        key = (src.data_ptr(), src.numel() * src.element_size())
        if key not in self._registered:
            # Keep the tensor alive while registered; released in close().
            self._registered[key] = (src, self._agent.register_memory(src))

    def _progress(self, inflight: deque) -> bool:
        """Poll in-flight transfers once; returns whether anything completed."""
        moved = False
        for _ in range(len(inflight)):
            peer, handle, xfers, deadline = inflight.popleft()
            try:
                states = [self._agent.check_xfer_state(x) for x in xfers]
            except Exception as err:  # nixl raises e.g. nixlRemoteDisconnectError
                peer._fail(PeerLostError(f"nixl WRITE to {peer.address} failed: {type(err).__name__}: {err}"))
                states = ["ERR"]
            if all(s == "DONE" for s in states):
                handle._finish()
            elif "ERR" in states or peer.error is not None or time.monotonic() > deadline:
                err = peer.error or (
                    PeerLostError(f"nixl WRITE to {peer.address} failed")
                    if "ERR" in states
                    else TransportTimeout(f"nixl WRITE to {peer.address} not done in time")
                )
                peer._fail(err)
                handle._finish(err)
            else:
                inflight.append((peer, handle, xfers, deadline))
                continue
            moved = True
            for x in xfers:
                try:
                    self._agent.release_xfer_handle(x)
                except Exception as err:  # releasing a failed transfer may itself fail
                    logger.debug("nixl release_xfer_handle failed: %s", err)
        return moved

    def _check_peers(self) -> None:
        for p in self._peers:
            if p.error is None and not p._closed and p._stream.peer_closed():
                p._fail(PeerLostError(f"nixl KV receiver {p.address} closed its control channel"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._peers:
            p.close()
        self._jobs.put("stop")
        self._thread.join(timeout=self.options.timeout_s)
        if any(p.error is not None for p in self._peers):  # a peer died mid-transfer: never deregister
            park_agent(self._agent, self._registered)
            self._agent = None
        elif not self._thread.is_alive():  # tear down now, while the source tensors are alive
            release_agent(self._agent, [descs for _, descs in self._registered.values()])
            self._registered.clear()
            self._agent = None
