# SPDX-License-Identifier: Apache-2.0
"""The receiving half of the NIXL KV push: regions registered with the local agent, an
authenticated control listener whose welcome carries the region table and agent metadata, and the
notifications of authenticated agents only, put back in issue order by `PeerSequencer`.
The protocol: nixl/__init__.py."""

from __future__ import annotations

import logging
import select
import threading
import time
from typing import Any

from vllm_disagg.errors import DisaggError, ProtocolError
from vllm_disagg.transport.base import (
    KVReceiver,
    RegionInfo,
    TransportOptions,
    TransportStats,
)
from vllm_disagg.transport.kv_common import MAX_NAME_BYTES, NotificationInbox, PeerSequencer, WriteMeta
from vllm_disagg.transport.nixl.agent import (
    KV_SERVICE,
    Poller,
    make_agent,
    pack_regions,
    parse_bye,
    parse_notif,
    release_agent,
    tensor_region,
)
from vllm_disagg.transport.server import AuthServer
from vllm_disagg.transport.wire import (
    T_BYE,
    SockStream,
    read_frame,
)

logger = logging.getLogger(__name__)


class NixlKVReceiver(NotificationInbox, KVReceiver):
    def __init__(self, options: TransportOptions, name: str):
        self.options, self.name = options, name
        self.stats = TransportStats()
        self._init_inbox()
        self._tensors: list[Any] = []
        self._infos: list[RegionInfo] = []
        self._addrs: list[tuple[int, int]] = []
        self._peers: dict[str, PeerSequencer] = {}
        self._departing: dict[str, tuple[int, float]] = {}  # agent -> (writes announced by BYE, deadline)
        self._closed = threading.Event()
        self._server: AuthServer | None = None

    def register_region(self, name: str, tensor: Any) -> RegionInfo:
        if self._server is not None or any(i.name == name for i in self._infos):
            raise ValueError(f"region {name!r}: register each name once, before start()")
        info, base, dev = tensor_region(name, tensor)
        self._tensors.append(tensor)
        self._infos.append(info)
        self._addrs.append((base, dev))
        return info

    def start(self) -> str:
        if self._server is not None:
            return self.address
        self._agent, self._agent_name = make_agent("kv-rx", self.options.host)
        self._reg: list = []
        if self._tensors:
            self._reg = [self._agent.register_memory(self._tensors)]
        self._welcome = pack_regions(self._infos, self._addrs, self._agent.get_agent_metadata())
        self._poller = threading.Thread(target=self._poll_loop, name="disagg-nixl-rx", daemon=True)
        self._poller.start()
        self._server = AuthServer(
            token=self.options.auth_token.encode(),
            service=KV_SERVICE,
            serve=self._serve_ctrl,
            welcome_info=self._admit,
            stats=self.stats,
            timeout_s=self.options.timeout_s,
            host=self.options.host,
            port=self.options.port,
        )
        return self.address

    @property
    def address(self) -> str:
        if self._server is None:
            raise RuntimeError("KV receiver not started")
        return self._server.address

    def _admit(self, hello: bytes) -> bytes:
        """Runs before WELCOME: the sender's agent name becomes an accepted notification source."""
        try:
            agent_name, _, peer_name = hello.decode().partition("\n")
        except UnicodeDecodeError:
            raise ProtocolError("nixl-kv hello is not UTF-8") from None
        if not agent_name or len(hello) > 2 * MAX_NAME_BYTES:
            raise ProtocolError("bad nixl-kv hello")
        with self._lock:
            if agent_name in self._peers:
                raise ProtocolError(f"nixl agent {agent_name!r} is already connected")
            self._peers[agent_name] = PeerSequencer(peer_name or agent_name)
        return self._welcome

    def _serve_ctrl(self, stream: SockStream, hello: bytes) -> None:
        """Hold the control socket: BYE is a clean goodbye, EOF means the sender died."""
        agent_name = hello.decode().partition("\n")[0]
        num_writes: int | None = None
        clean = False
        try:
            while not self._closed.is_set():
                if select.select([stream.sock], [], [], 0.5)[0]:
                    ftype, meta, _ = read_frame(stream)
                    clean = ftype == T_BYE
                    num_writes = parse_bye(meta, stream.peer) if clean else None
                    break
        except DisaggError as err:
            clean = False
            logger.info("nixl KV sender %s control channel: %s", stream.peer, err)
        finally:
            self._depart(agent_name, clean, num_writes)

    def _depart(self, agent_name: str, clean: bool, num_writes: int | None) -> None:
        """A clean BYE may overtake the sender's last notifications (they come through NIXL, not
        this socket): its agent stays accepted until all `num_writes` arrived, or `timeout_s`."""
        with self._lock:
            seqr = self._peers.get(agent_name)
            if seqr is None:
                return
            if clean and num_writes is not None and seqr.next_seq < num_writes:
                deadline = time.monotonic() + self.options.timeout_s
                self._departing[agent_name] = (num_writes, deadline)
                return
            del self._peers[agent_name]
            if not clean and not self._closed.is_set():
                self._lost.append(seqr.name)

    def _expire_departed(self) -> None:
        now = time.monotonic()
        with self._lock:
            for agent_name, (num_writes, deadline) in list(self._departing.items()):
                if now > deadline:
                    seqr = self._peers.pop(agent_name)
                    del self._departing[agent_name]
                    self._lost.append(seqr.name)
                    logger.warning(
                        "nixl KV sender %s said goodbye after %d writes; %d were notified within %.0fs",
                        seqr.name,
                        num_writes,
                        seqr.next_seq,
                        self.options.timeout_s,
                    )

    def _poll_loop(self) -> None:
        poller = Poller(self.options.spin_us * 1e-6)
        while not self._closed.is_set():
            got = self._agent.get_new_notifs()
            if not got:
                if self._departing:
                    self._expire_departed()
                poller.pause()
                continue
            poller.active()
            for agent_name, msgs in got.items():
                for raw in msgs:
                    self._on_notif(agent_name, raw)

    def _on_notif(self, agent_name: str, raw: bytes) -> None:
        with self._lock:
            seqr = self._peers.get(agent_name)
        try:
            if seqr is None:
                raise ProtocolError(f"notification from unauthenticated nixl agent {agent_name!r}")
            seq, layer, nbytes, transfer_id = parse_notif(raw, agent_name)
            ready = seqr.chunk_done(WriteMeta(seq, 0, 1, layer, 0, transfer_id, None), nbytes)
        except ProtocolError as err:
            self.stats.record_rejected()
            logger.warning("KV receiver %s rejected a notification: %s", self.name, err)
            return
        for n in ready:
            self.stats.record_received(n.nbytes, notifications=1)
            self._notifs.put(n)
        if ready and agent_name in self._departing:
            with self._lock:
                num_writes, _ = self._departing.get(agent_name, (None, 0.0))
                if num_writes is not None and seqr.next_seq >= num_writes:  # the last one: gone now
                    del self._departing[agent_name]
                    self._peers.pop(agent_name, None)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._server is not None:
            self._server.close()
            self._poller.join(timeout=2)
            if not self._poller.is_alive():  # tear down now, while our tensors are alive
                release_agent(self._agent, self._reg)
                self._agent = None
