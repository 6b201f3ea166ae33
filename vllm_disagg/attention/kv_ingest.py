# SPDX-License-Identifier: Apache-2.0
"""Prefill -> attention server: the server's KV receiver, so a prefill instance pushes straight into it.

The prefill instance's `PushSender` (the P/D connector, unchanged transport) writes whole blocks of
each layer into this server's cache regions: head-wise, each server's block is one KV-head slice of
the prefill block (contiguous in the CPU layout `[num_blocks, num_kv_heads, block_size, 2*head_dim]`);
request-wise, whole blocks. Block ids are the decode model worker's, which are the servers' ids.
The decode model worker polls the bytes landed per transfer (`GET /kv/landed`); counts nobody
collects expire. Lifecycle, polling and reclaiming: README.md, "kv_ingest.py".
"""

from __future__ import annotations

import threading
import time
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge
from vllm.logger import init_logger

from vllm_disagg.config import check_host_port
from vllm_disagg.errors import DisaggError
from vllm_disagg.transport import TransportOptions, checksum, get_transport

logger = init_logger(__name__)
TTL_S = 120.0
_MAX_ENTRIES = 4096
_MAX_IDS = 256  # per poll; a decode worker has at most a batch of pending pushes
_ID_CHARS = frozenset("0123456789abcdefABCDEF-_")
_MAX_BLOCKS = 4096  # per checksum query: one push's blocks (a 64k-token prompt in 16-token blocks)


class KVIngest:
    """The KV receiver of one attention server (`transport` must be the prefill side's kv.transport)."""

    def __init__(self, transport: str, auth_token: str, host: str = "127.0.0.1", port: int = 0,
                 registry: CollectorRegistry | None = None, poll_s: float = 0.001, ttl_s: float = TTL_S,
                 advertise: str | None = None):
        if advertise is not None and transport != "tcp":
            raise ValueError(f"--kv-advertise needs --kv-transport tcp (got {transport}): only a TCP address can "
                             "stand in front of this receiver")
        self.advertise = None if advertise is None else check_host_port(advertise)
        """What prefill instances are told to connect to (a proxy, a NAT, a Service); None: `listen_address`."""
        self.kind = transport
        self._transport = get_transport(transport, TransportOptions(auth_token=auth_token, host=host, port=port))
        self._receiver = None
        self._caches: list = []
        self.address: str | None = None
        self.listen_address: str | None = None
        self._lock = threading.Lock()
        self._landed: dict[str, list[float]] = {}  # transfer_id -> [bytes, last update]
        self._poll_s = poll_s
        self.ttl_s = ttl_s
        self.num_reclaimed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bytes_landed = Counter("vllm:disagg_attention_kv_ingest_bytes",
                                    "KV bytes pushed by prefill instances that landed in this server's cache",
                                    registry=registry)
        self.writes = Counter("vllm:disagg_attention_kv_ingest_writes", "Prefill KV writes that landed",
                              registry=registry)
        self.checksum_queries = Counter("vllm:disagg_attention_kv_checksum_queries",
                                        "Verified pushes' checksum queries answered (kv.verify_checksums)",
                                        registry=registry)
        self.unclaimed = Gauge("vllm:disagg_attention_kv_ingest_unclaimed",
                               "Landed-byte counts of pushes no decode worker has collected yet", registry=registry)
        self.unclaimed.set_function(lambda: len(self._landed))

    def attach(self, caches: list) -> str:
        """Expose `caches` (one tensor per layer, `[num_blocks, ...]`) as regions "0".."L-1"."""
        old = self._receiver
        if old is not None:
            old.close()
        receiver = self._transport.kv_receiver(name="attention")
        for layer, tensor in enumerate(caches):
            receiver.register_region(str(layer), tensor)
        self.listen_address = receiver.start()
        self.address = self.advertise or self.listen_address
        with self._lock:
            self._receiver, self._caches = receiver, list(caches)
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain_loop, name="attn-kv-ingest", daemon=True)
            self._thread.start()
        logger.info("attention server: prefill KV pushes land at %s (%s)%s", self.listen_address, self.kind,
                    f", advertised as {self.address}" if self.advertise else "")
        return self.address

    def info(self) -> dict:
        return {"kv_address": self.address, "kv_listen_address": self.listen_address, "kv_transport": self.kind}

    def _drain_loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            with self._lock:
                receiver = self._receiver
            if receiver is None:
                continue
            try:
                notes = receiver.poll_notifications()
            except DisaggError as err:  # a closed (replaced) receiver
                logger.debug("KV ingest: %s", err)
                continue
            if notes:
                self._count(notes)
            self._gc(time.monotonic())

    def _count(self, notes) -> None:
        now = time.monotonic()
        with self._lock:
            for note in notes:
                entry = self._landed.setdefault(note.transfer_id, [0, now])
                entry[0] += note.nbytes
                entry[1] = now
        self.bytes_landed.inc(sum(n.nbytes for n in notes))
        self.writes.inc(len(notes))

    def _gc(self, now: float) -> None:
        with self._lock:
            stale = [t for t, (_, seen) in self._landed.items() if now - seen > self.ttl_s]
            stale += list(self._landed)[:max(0, len(self._landed) - len(stale) - _MAX_ENTRIES)]
            for transfer_id in stale:
                self._landed.pop(transfer_id, None)
        if stale:
            self.num_reclaimed += len(stale)
            logger.info("KV ingest: reclaimed %d push counts nobody collected", len(stale))

    def landed(self, ids: list[str], forget: bool = False) -> dict[str, int]:
        with self._lock:
            out = {t: int(self._landed[t][0]) if t in self._landed else -1 for t in ids}
            if forget:
                for t in ids:
                    self._landed.pop(t, None)
        return out

    def fence(self, ids: list[str]) -> dict[str, bool]:
        """The decode worker gave up on these pushes and reuses their blocks: drop their later bytes
        (`KVReceiver.fence`). True per id once none of its writes is mid-landing here."""
        with self._lock:
            receiver = self._receiver
            for t in ids:
                self._landed.pop(t, None)
        return {t: receiver is None or receiver.fence(t) for t in ids}

    def checksums(self, block_ids: list[int]) -> str:
        """Each layer's CRC32 over these blocks as they are now (transport/checksum.py): the decode
        worker compares them with the prefill side's for a verified push (`kv.verify_checksums`)."""
        with self._lock:
            caches = self._caches
        if not caches:
            raise ValueError("no KV cache attached yet (no INIT)")
        if any(b < 0 or b >= caches[0].shape[0] for b in block_ids):
            raise ValueError(f"block ids: each in [0, {caches[0].shape[0]})")
        self.checksum_queries.inc()
        return checksum.encode(checksum.layer_checksums(caches, block_ids))

    def http_checksums(self, path: str) -> dict[str, str]:
        """`/kv/checksums?blocks=1,2` (token required); ValueError (-> HTTP 400) on anything malformed."""
        raw = ",".join(parse_qs(urlsplit(path).query).get("blocks", []))
        parts = [b for b in raw.split(",") if b]
        if not parts or len(parts) > _MAX_BLOCKS or not all(b.isdigit() and len(b) <= 9 for b in parts):
            raise ValueError(f"blocks: 1..{_MAX_BLOCKS} block ids, comma-separated")
        return {"crc32": self.checksums([int(b) for b in parts])}

    def http_landed(self, path: str) -> dict[str, int]:
        """`/kv/landed?ids=A,B[&forget=1]`; ValueError (-> HTTP 400) on anything malformed."""
        query = parse_qs(urlsplit(path).query)
        return self.landed(_ids(query), forget=query.get("forget", ["0"])[0] == "1")

    def http_fence(self, path: str) -> dict[str, bool]:
        """`POST /kv/fence?ids=A,B` (authorized by the server); ValueError (-> HTTP 400) if malformed."""
        return self.fence(_ids(parse_qs(urlsplit(path).query)))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        with self._lock:
            receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()


def _ids(query: dict[str, list[str]]) -> list[str]:
    ids = [t for t in ",".join(query.get("ids", [])).split(",") if t]
    if len(ids) > _MAX_IDS or any(len(t) > 64 or not set(t) <= _ID_CHARS for t in ids):
        raise ValueError(f"ids: at most {_MAX_IDS} transfer ids of [0-9a-f-_], 64 chars each")
    return ids
