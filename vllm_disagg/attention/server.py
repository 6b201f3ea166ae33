# SPDX-License-Identifier: Apache-2.0
"""The attention server: its own process (not a vLLM engine) that owns one shard of the paged KV
(all layers x its KV heads) and computes attention for it, layer by layer.

Lifecycle: `start()` opens a `MsgListener` on the chosen transport and an HTTP port (`server_http.py`:
`/health`, `/metrics`, `/kv/retained`, `/kv/landed`, `POST /kv/fence`); each accepted channel is served by one thread
(`wire.py` documents the conversation). The KV survives a client reconnect with the same geometry, so a
restarted model worker loses nothing: the blocks the old session registered become the retained set
(`retain.py`), listed at `GET /kv/retained` and copied into the new session's blocks by RESTORE. Prefill
pushes (`--kv-transport`, `kv_ingest.py`) write blocks unseen by this code, so the decode worker CLAIMs a
push's blocks before registering it with the prefill side (same write check). `stop()` closes everything.
A bad frame gets an ERROR reply and the server keeps serving; a lost peer ends only that session.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import OrderedDict
from http.server import ThreadingHTTPServer

import numpy as np
import torch

from vllm_disagg import envs
from vllm_disagg.attention import wire
from vllm_disagg.attention.kernels import AttentionKernel, kv_bytes_per_block, make_kernel, preload
from vllm_disagg.attention.retain import KVRetention
from vllm_disagg.attention.server_http import ServerMetrics, handler_for
from vllm_disagg.attention.spans import ServeSpans
from vllm_disagg.errors import DisaggError, ProtocolError, TransportTimeout
from vllm_disagg.logs import init_logger
from vllm_disagg.transport import TransportOptions, get_transport

logger = init_logger(__name__)
_META_CACHE = 8  # steps whose metadata we keep (pipelining keeps a few in flight)
_QKV, _Q, _KV = ("q", "k", "v"), ("q",), ("k", "v")
_STEP_FLAGS = wire.HAS_TRACE | wire.HAS_META
_STEP_TYPES = frozenset((wire.ATTN, wire.QPREV, wire.KV))  # the frames of a step's layers


_PROCESS_KERNEL_LOCK = threading.Lock()


class DisaggAttentionServer:
    """One attention worker. `kv_cache_bytes` bounds its KV; capacity in blocks follows from the
    geometry the first client sends."""

    def __init__(self, transport: str = "shm", kv_cache_bytes: int = 256 << 20, kernel: str = "cpu",
                 http_host: str = "127.0.0.1", http_port: int = 0, auth_token: str | None = None,
                 recv_timeout_s: float = 1.0, num_threads: int | None = None, data_port: int = 0,
                 spin_us: float | None = None, kv_transport: str | None = None, kv_port: int = 0,
                 retain_ttl_s: float = 600.0, retain_copy_bytes: int | None = None,
                 kv_ingest_ttl_s: float | None = None, kv_advertise: str | None = None):
        token = auth_token or envs.auth_token()
        if not token:
            raise ValueError("attention server needs a shared token: set VLLM_DISAGG_AUTH_TOKEN")
        self.transport_kind = transport
        self._token = token
        spin = {} if spin_us is None else {"spin_us": spin_us}  # None: the transport's default
        self.transport = get_transport(transport, TransportOptions(auth_token=token, host=http_host,
                                                                      port=data_port, **spin))
        self.kv_cache_bytes = kv_cache_bytes
        self.kernel_kind = kernel
        self.num_threads = num_threads
        self.kernel: AttentionKernel | None = None
        self.metrics = ServerMetrics()
        self.ingest = None  # prefill -> this server's KV (LL, kv_ingest.py); None: no prefill pushes here
        if kv_transport:
            from vllm_disagg.attention.kv_ingest import KVIngest

            ttl = {} if kv_ingest_ttl_s is None else {"ttl_s": kv_ingest_ttl_s}
            self.ingest = KVIngest(kv_transport, token, http_host, port=kv_port, registry=self.metrics.registry,
                                   advertise=kv_advertise, **ttl)
        elif kv_advertise:
            raise ValueError("--kv-advertise needs --kv-transport: without it this server takes no prefill KV")
        # a prefill push writes block memory directly, unseen by this server: the decode worker CLAIMs
        # the destination blocks first (`_claim`), so retention still sees every write
        copy_bytes = kv_cache_bytes // 4 if retain_copy_bytes is None else retain_copy_bytes
        self.retention = KVRetention(retain_ttl_s, copy_bytes)
        self.metrics.retained.set_function(lambda: self.retention.num_retained)
        self.metrics.retained_copy_bytes.set_function(lambda: self.retention.copy_bytes)
        self.metrics.registered.set_function(lambda: self.retention.num_registered)
        self._http_addr = (http_host, http_port)
        self._recv_timeout = recv_timeout_s
        # one kernel call at a time: sessions share the KV, and vLLM's CPU kernels share one
        # unlocked process-wide scratch pad (nanoflow/executor.CPU_KERNEL_LOCK), so several servers
        # in one process (tests, embedding) must not compute concurrently either
        self._lock = _PROCESS_KERNEL_LOCK
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.listener = None
        self.httpd: ThreadingHTTPServer | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> dict:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        preload(self.kernel_kind)
        self.listener = self.transport.listen_msg()
        self.httpd = ThreadingHTTPServer(self._http_addr, handler_for(self))
        self._spawn(self.httpd.serve_forever, "attn-http")
        self._spawn(self._accept_loop, "attn-accept")
        info = self.info()
        logger.info("attention server ready: %s", info)
        return info

    def info(self) -> dict:
        host, port = self.httpd.server_address[:2] if self.httpd else self._http_addr
        return {
            "status": "ok", "http": f"{host}:{port}", "address": self.listener.address if self.listener else None,
            "transport": self.transport_kind, "kernel": self.kernel_kind,
            "num_blocks": self.kernel.num_blocks if self.kernel else None,
            "kv_cache_dtype": self.kernel.geometry.kv_cache_dtype if self.kernel else None,
            "protocol": wire.PROTOCOL_VERSION, "retain_ttl_s": self.retention.ttl_s,
            **(self.ingest.info() if self.ingest else {}),
        }

    def stop(self) -> None:
        self._stop.set()
        if self.httpd:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self.listener:
            self.listener.close()
        if self.ingest:
            self.ingest.close()
        for t in self._threads:  # daemon threads: a slow one must not hold up the exit
            t.join(timeout=1)

    def _spawn(self, fn, name, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                ch = self.listener.accept(timeout=0.5)
            except TransportTimeout:
                continue
            except DisaggError as err:
                if self._stop.is_set():
                    return
                logger.warning("attention server: accept failed: %s", err)
                continue
            self._spawn(self._serve_channel, "attn-session", ch)

    # ---- one session -----------------------------------------------------------------------
    def _serve_channel(self, ch) -> None:
        if self.num_threads:
            # OpenMP's thread count is per OS thread: the kernels run on this one, and left at the
            # default (one per core) their idle OpenMP workers spin on our core after every call
            torch.set_num_threads(self.num_threads)
        session = _Session()
        self.metrics.sessions.inc()
        try:
            while not self._stop.is_set():
                try:
                    msg = ch.recv(timeout=self._recv_timeout)
                except TransportTimeout:
                    continue
                self.metrics.queue.inc()
                try:
                    self._handle(ch, session, msg)
                finally:
                    self.metrics.queue.dec()
        except DisaggError as err:  # lost peer, broken frame: only this session ends
            logger.warning("attention session ended: %s", err)  # seen only at INFO, a CI hang went undiagnosed
        finally:
            self.metrics.sessions.dec()
            session.spans.close()
            ch.close()

    def _handle(self, ch, session: _Session, msg) -> None:
        start = time.perf_counter()
        try:
            self._handle_one(ch, session, msg)
        finally:
            self.metrics.busy.inc(time.perf_counter() - start)

    def _handle_one(self, ch, session: _Session, msg) -> None:
        try:
            h = wire.unpack_header(msg.header)
        except ProtocolError as err:
            self._reply_error(ch, 0, str(err))
            return
        self.metrics.bytes_in.inc(sum(msg.lengths))
        self.metrics.message(h.mtype).inc()
        started_ns = time.time_ns()
        try:
            bufs = msg.buffers
            if h.flags & _STEP_FLAGS:  # a step (or INIT) starts: its trace, if any
                session.trace, bufs = wire.decode_trace(h, bufs)
            reply = self._dispatch(session, h, bufs)
        except (ProtocolError, ValueError, RuntimeError, NotImplementedError) as err:
            self._reply_error(ch, h.seq, f"{wire.TYPE_NAMES[h.mtype]} seq {h.seq}: {err}")
            return
        if reply is not None:
            header, tensors = reply
            ch.send(header.pack(), tensors)
            self.metrics.bytes_out.inc(sum(t.nbytes for t in tensors))  # tensors or memoryviews
        if session.geometry is not None and h.mtype in _STEP_TYPES:
            session.spans.frame(h, session.trace if h.has_meta else None, started_ns, session.geometry.num_layers)

    def _reply_error(self, ch, seq: int, text: str) -> None:
        self.metrics.errors.inc()
        logger.warning("attention server: rejected frame: %s", text)
        ch.send(wire.Header(wire.ERROR, seq=seq).pack(), [memoryview(text.encode()[:4096])])

    def _dispatch(self, session: _Session, h: wire.Header, bufs: list[memoryview]):
        if h.mtype == wire.INIT:
            return self._init(session, h, bufs)
        if h.mtype == wire.PING:
            return wire.Header(wire.PONG, seq=h.seq), []
        if session.geometry is None or self.kernel is None:
            raise ProtocolError("no INIT on this channel yet")
        if h.mtype == wire.ATTN:
            return self._attn(session, h, bufs)
        if h.mtype == wire.QPREV:
            return self._qprev(session, h, bufs)
        if h.mtype == wire.KV:
            self._kv(session, h, bufs)
            return None
        if h.mtype == wire.RESTORE:
            return self._restore(h, bufs)
        if h.mtype == wire.CLAIM:
            return self._claim(h, bufs)
        raise ProtocolError(f"unexpected {wire.TYPE_NAMES[h.mtype]} from a client")

    def _init(self, session: _Session, h: wire.Header, bufs):
        if len(bufs) != 1:
            raise ProtocolError(f"INIT carries 1 payload, got {len(bufs)}")
        g = wire.Geometry.from_json(bufs[0])
        with self._lock:
            if self.kernel is None or self.kernel.geometry != g:
                num_blocks = self.kv_cache_bytes // kv_bytes_per_block(g)
                if num_blocks < 1:
                    raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} holds no block of {g}")
                self.retention.reset()
                self.kernel = make_kernel(self.kernel_kind, g, num_blocks)
                if self.ingest is not None:
                    self.ingest.attach(self.kernel.caches)
                logger.info("attention server: %d blocks for %s", num_blocks, g)
            elif not h.flags & wire.RESUME:  # same geometry: a restarted model worker, keep what it registered
                num = self.retention.new_session()
                logger.info("attention server: new session keeps the KV; %d blocks retained for %.0f s",
                            num, self.retention.ttl_s)
        session.geometry = g
        # reused for every reply (sent before the next message is read): no allocation per layer
        session.out = torch.empty(g.max_num_tokens, g.num_heads, g.head_size, dtype=g.torch_dtype)
        session.out_bytes = wire.byte_view(session.out)  # lives as long as session.out
        reply = {"num_blocks": self.kernel.num_blocks, "supports_lse": self.kernel.supports_lse,
                 "kernel": self.kernel_kind, "retained": self.retention.num_retained}
        return wire.Header(wire.INIT_OK, seq=h.seq), [torch.frombuffer(bytearray(json.dumps(reply).encode()),
                                                                       dtype=torch.uint8)]

    def _tensors(self, session: _Session, h: wire.Header, bufs, names: list[str]):
        """Split payloads into the named activations and the step metadata (cached by meta_id)."""
        g = session.geometry
        n = len(names)
        expect = n
        if h.flags:  # most layer frames carry neither metadata nor registrations
            if h.has_reg and not h.has_meta:
                raise ProtocolError("block registrations travel only with step metadata (HAS_META)")
            expect += (4 if h.has_meta else 0) + (2 if h.has_reg else 0)
        if len(bufs) != expect:
            raise ProtocolError(f"expected {expect} payloads, got {len(bufs)}")
        if not 0 <= h.layer < g.num_layers or h.num_tokens > g.max_num_tokens:
            raise ProtocolError(f"layer {h.layer} / {h.num_tokens} tokens outside the INIT geometry")
        if h.has_meta:
            meta = wire.decode_meta(h, bufs[n:n + 4], self.kernel.num_blocks, g.block_size)
            regs = wire.decode_block_keys(bufs[n + 4:], self.kernel.num_blocks, "registrations") if h.has_reg else None
            meta = wire.StepMeta(*(t.clone() for t in meta.tensors()))  # own it: buffers get reused
            session.remember(h.meta_id, meta)
            self._new_step(meta, regs, g.block_size)
        meta, state = session.lookup(h.meta_id)
        heads = {"q": g.num_heads, "k": g.num_kv_heads, "v": g.num_kv_heads}
        dtype, shape = g.torch_dtype, (h.num_tokens, 0, g.head_size)
        acts = [wire.as_tensor(bufs[i], dtype, (shape[0], heads[x], shape[2]), x) for i, x in enumerate(names)]
        if meta.slot_mapping.shape[0] != h.num_tokens:
            raise ProtocolError(f"{h.num_tokens} tokens but the step metadata has {meta.slot_mapping.shape[0]}")
        return acts, meta, state

    def _attn(self, session: _Session, h: wire.Header, bufs):
        (q, k, v), meta, _ = self._tensors(session, h, bufs, _QKV)
        out = session.out[: h.num_tokens]
        with self._lock, self._timed(h.layer):
            state = session.state_for(h.meta_id, self.kernel, h.layer)
            self.kernel.write_kv(h.layer, k, v, meta)
            self.kernel.attend(h.layer, q, meta, state, h.scale, out)
        return (wire.Header(wire.OUT, seq=h.seq, layer=h.layer, num_tokens=h.num_tokens),
                [session.out_bytes[: out.nbytes]])

    def _qprev(self, session: _Session, h: wire.Header, bufs):
        (q,), meta, _ = self._tensors(session, h, bufs, _Q)
        if meta.num_reqs != h.num_tokens:
            raise ProtocolError("QPREV needs a decode-only step (one token per request)")
        with self._lock, self._timed(h.layer):
            out, lse = self.kernel.attend_prev(h.layer, q, meta, h.scale)
        return (wire.Header(wire.OUT_LSE, seq=h.seq, layer=h.layer, num_tokens=h.num_tokens),
                [out.contiguous(), lse.contiguous()])

    def _kv(self, session: _Session, h: wire.Header, bufs):
        (k, v), meta, _ = self._tensors(session, h, bufs, _KV)
        with self._lock:
            self.kernel.write_kv(h.layer, k, v, meta)

    def _new_step(self, meta: wire.StepMeta, regs, block_size: int) -> None:
        """Once per step (its metadata): apply the registrations, then drop the registrations of
        (and copy retained data out of) the blocks this step writes."""
        retention = self.retention
        if regs is None and not retention.needs_write_check():
            return  # the common case: nothing registered or retained, no per-step work
        with self._lock:
            if regs is not None:
                retention.register(*regs)
            if retention.needs_write_check():  # padding slots (-1) give block -1: never registered
                written = np.unique(meta.slot_mapping.numpy() // block_size).tolist()
                retention.before_write(written, self.kernel)

    def _restore(self, h: wire.Header, bufs):
        """Registrations riding on a RESTORE (HAS_REG) predate it: applied first."""
        n = self.kernel.num_blocks
        if len(bufs) != (4 if h.has_reg else 2):
            raise ProtocolError(f"RESTORE carries {4 if h.has_reg else 2} payloads, got {len(bufs)}")
        block_ids, keys = wire.decode_block_keys(bufs[:2], n, "RESTORE")
        regs = wire.decode_block_keys(bufs[2:], n, "registrations") if h.has_reg else None
        with self._lock:
            if regs is not None:
                self.retention.register(*regs)
            failed = self.retention.restore(block_ids, keys, self.kernel)
        self.metrics.restored.inc(len(block_ids) - len(failed))
        self.metrics.restore_misses.inc(len(failed))
        return (wire.Header(wire.RESTORE_OK, seq=h.seq, num_tokens=len(failed)),
                [torch.tensor(failed, dtype=torch.int32)])

    def _claim(self, h: wire.Header, bufs):
        """A prefill push will write into these blocks: the write check of `_new_step` runs now, before
        the decode worker registers the push with the prefill side (registrations riding here first)."""
        n = self.kernel.num_blocks
        if len(bufs) != (3 if h.has_reg else 1):
            raise ProtocolError(f"CLAIM carries {3 if h.has_reg else 1} payloads, got {len(bufs)}")
        block_ids = wire.decode_block_ids(bufs[0], n, "CLAIM")
        regs = wire.decode_block_keys(bufs[1:], n, "registrations") if h.has_reg else None
        with self._lock:
            if regs is not None:
                self.retention.register(*regs)
            if self.retention.needs_write_check():
                self.retention.before_write(block_ids, self.kernel)
        return wire.Header(wire.CLAIM_OK, seq=h.seq, num_tokens=len(block_ids)), []

    def retained_info(self) -> dict:
        """The body of `GET /kv/retained`."""
        keys, ttl = self.retention.keys()
        g = self.kernel.geometry if self.kernel else None
        return {"block_size": g.block_size if g else None, "geometry": g.as_dict() if g else None,
                "keys": [k.hex() for k in keys], "ttl_s": round(ttl, 3), "retain_ttl_s": self.retention.ttl_s}

    def authorized(self, header: str | None) -> bool:
        expect = f"Bearer {self._token}".encode()
        return hmac.compare_digest((header or "").encode(), expect)

    def _timed(self, layer: int):
        return _Timer(self.metrics.layer(layer))


class _Session:
    """Per-channel state: the client's geometry and recent step metadata."""

    def __init__(self) -> None:
        self.geometry: wire.Geometry | None = None
        self.out: torch.Tensor | None = None
        self.out_bytes: memoryview | None = None
        self._metas: OrderedDict[int, list] = OrderedDict()
        self.trace = None
        """W3C trace context (`TraceContext`) of the step (or INIT) being served, if the client sent one."""
        self.spans = ServeSpans()
        """`attention.serve` spans of the sampled steps in flight (attention/spans.py)."""

    def remember(self, meta_id: int, meta: wire.StepMeta) -> None:
        self._metas[meta_id] = [meta, {}]
        self._metas.move_to_end(meta_id)
        while len(self._metas) > _META_CACHE:
            self._metas.popitem(last=False)

    def lookup(self, meta_id: int):
        entry = self._metas.get(meta_id)
        if entry is None:
            raise ProtocolError(f"unknown meta_id {meta_id}: send the step metadata with HAS_META first")
        return entry

    def state_for(self, meta_id: int, kernel: AttentionKernel, layer: int):
        """The step's kernel state for `layer`: one per scheduler window (a hybrid model's groups)."""
        meta, states = self.lookup(meta_id)
        window = kernel.sched_window(layer)
        state = states.get(window)
        if state is None:
            state = states[window] = kernel.prepare(meta, window)
        return state


class _Timer:
    def __init__(self, hist) -> None:
        self.hist = hist

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.hist.observe(time.perf_counter() - self.t0)
