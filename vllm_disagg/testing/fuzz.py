# SPDX-License-Identifier: Apache-2.0
"""Corpus-driven fuzzing of the plugin's binary ports (issue 18): no server may crash on bad input.

A port is fuzzed at two depths. `pre_auth` plays a stranger without the token: garbage, truncated
and oversized frames, a mangled AUTH, silence; the listener must refuse each one and keep serving.
`post_auth` (the token holder: only against a server that holds nothing of value, since a trusted
peer may legally write any block) sends mutations of valid messages of the port's own protocol
(KV side channel `DGKV`, attention `LAMA`, KV receiver `KV_WRITE`) inside well-formed transport
frames, and mutated transport frames themselves. Every `check_every` frames, and at the end, a
valid request must still be answered (`FuzzTarget.probe`) and the server process, when there is
one, must be alive: else it counts in `server_crashes_from_bad_input`. Used by the unit tests (a
few hundred frames) and `benchmarks/chaos.py` (10,000 and more per port).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_disagg.errors import DisaggError
from vllm_disagg.transport import wire

__all__ = ["FuzzResult", "FuzzTarget", "fuzz_port", "mutate"]

_EXTREMES = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1)


@dataclass
class FuzzTarget:
    """One listening port and how to talk to it."""

    name: str
    address: str
    """HOST:PORT."""
    service: bytes
    """The transport service its handshake binds (b"msg" for message channels, b"kv" for KV receivers)."""
    token: str
    seeds: list[tuple[bytes, list[bytes]]] = field(default_factory=list)
    """Valid application messages (post-auth): (MSG header, payloads) for b"msg", (KV_WRITE meta, [])
    for b"kv"."""
    probe: Callable[[], bool] | None = None
    """A valid request that must still be answered; None: a fresh authenticated connection must work."""
    pid: int | None = None
    """The server's process, when it runs out of this one (checked with kill(pid, 0))."""
    hello: bytes = b""
    """What an honest client says in AUTH (the KV receiver wants a session id)."""


@dataclass
class FuzzResult:
    name: str
    num_frames: int = 0
    num_pre_auth: int = 0
    num_post_auth: int = 0
    num_probes: int = 0
    failed_probes: int = 0
    server_crashes_from_bad_input: int = 0
    seconds: float = 0.0
    first_failure: str | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def mutate(rng: random.Random, seed: bytes, corpus: list[bytes]) -> bytes:
    """One mutation of `seed`: bit flips, an extreme value over a length field, truncation,
    extension, a splice with another seed, a deleted or repeated range, or plain noise."""
    data = bytearray(seed)
    kind = rng.randrange(8)
    if kind == 0 and data:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == 1 and data:
        width = rng.choice((1, 2, 4, 8))
        i = rng.randrange(max(1, len(data) - width + 1))
        value = rng.choice(_EXTREMES) & ((1 << (8 * width)) - 1)
        data[i:i + width] = value.to_bytes(width, rng.choice(("little", "big")))
    elif kind == 2 and data:
        del data[rng.randrange(len(data)):]
    elif kind == 3:
        data += rng.randbytes(rng.randint(1, 4096))
    elif kind == 4 and corpus:
        other = rng.choice(corpus)
        cut = rng.randrange(len(data) + 1)
        data = data[:cut] + other[rng.randrange(len(other) + 1):]
    elif kind == 5 and len(data) > 1:
        i = rng.randrange(len(data))
        j = rng.randrange(i, len(data))
        data[i:j] = data[i:j] * rng.randint(0, 3)
    elif kind == 6:
        data = bytearray(rng.randbytes(rng.randint(0, 256)))
    else:
        data[rng.randrange(len(data) + 1):rng.randrange(len(data) + 1)] = rng.randbytes(rng.randint(1, 64))
    return bytes(data)


def _connect(address: str, timeout: float) -> socket.socket:
    return wire.connect_socket(address, timeout)


def _drain(sock: socket.socket, timeout: float) -> None:
    """Read whatever the server answers until it closes or goes quiet (never blocks past `timeout`)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def _frame(ftype: int, meta: bytes, payload_len: int = 0, version: int = wire.PROTOCOL_VERSION) -> bytes:
    return wire.frame_head(ftype, meta, payload_len, version=version) + meta  # a valid CRC: the parser sees it


def _pre_auth_bytes(rng: random.Random, target: FuzzTarget) -> tuple[bytes, bool]:
    """(bytes to send, whether to read the CHALLENGE first) for one stranger."""
    auth = _frame(wire.FrameType.AUTH, os.urandom(64) + target.hello)
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 512)), rng.random() < 0.5
    if kind == 1:  # oversized: a header that claims gigabytes
        return wire.FRAME_HDR.pack(wire.MAGIC, wire.PROTOCOL_VERSION, rng.choice(list(wire.FrameType)),
                                   rng.choice((wire.MAX_META_BYTES + 1, 2**32 - 1)), 2**63 - 1, 0), True
    if kind == 2:  # truncated AUTH
        return auth[:rng.randrange(len(auth))], True
    if kind == 3:  # an AUTH with a wrong MAC, or another protocol version
        return _frame(wire.FrameType.AUTH, os.urandom(64), version=rng.choice((0, 1, 9, 0xFFFF))), True
    if kind == 4:
        return mutate(rng, auth, [auth]), True
    if kind == 5:  # a valid-looking frame of a type that does not belong here
        return _frame(rng.choice((wire.FrameType.KV_WRITE, wire.FrameType.MSG, wire.FrameType.WELCOME)),
                      rng.randbytes(rng.randint(0, 64))), True
    return b"", rng.random() < 0.5  # connect and say nothing (bounded by the server's handshake timeout)


def _stranger(rng: random.Random, target: FuzzTarget) -> None:
    data, read_first = _pre_auth_bytes(rng, target)
    sock = _connect(target.address, 5.0)
    try:
        if read_first:
            sock.settimeout(5.0)
            try:
                sock.recv(wire.FRAME_HDR.size + wire.NONCE_BYTES)
            except OSError:
                pass
        if data:
            try:
                sock.sendall(data)
            except OSError:
                pass
        _drain(sock, 0.05 if data else 0.01)
    finally:
        sock.close()


def _authenticated(target: FuzzTarget) -> wire.SockStream:
    stream = wire.SockStream(_connect(target.address, 5.0), target.address, 5.0)
    wire.client_handshake(stream, target.token.encode(), target.service, target.hello or _hello(target))
    if target.service == b"msg":
        pass
    return stream


def _hello(target: FuzzTarget) -> bytes:
    if target.service == b"kv":
        from vllm_disagg.transport.kv_common import pack_hello

        return pack_hello(os.urandom(16), 0, "fuzz")
    return b""


def _msg_frame(header: bytes, payloads: list[bytes]) -> bytes:
    from vllm_disagg.transport.msg import pack_msg

    head, _ = pack_msg(header, [memoryview(p) for p in payloads])
    return head + b"".join(payloads)


def _post_auth_frame(rng: random.Random, target: FuzzTarget) -> bytes:
    """One authenticated frame: a mutated application message in a well-formed transport frame, or a
    mutated transport frame."""
    head, payloads = rng.choice(target.seeds) if target.seeds else (b"", [])
    heads = [h for h, _ in target.seeds]
    app = mutate(rng, head, heads) if rng.random() < 0.8 else head
    if target.service == b"msg":
        payloads = list(payloads)
        if payloads and rng.random() < 0.5:
            i = rng.randrange(len(payloads))
            payloads[i] = mutate(rng, payloads[i], payloads)
        if rng.random() < 0.2:
            payloads = payloads[:rng.randrange(len(payloads) + 1)] + [rng.randbytes(rng.randint(0, 64))]
        frame = _msg_frame(app[:wire.MAX_HEADER_BYTES], payloads[:wire.MAX_TENSORS])
    else:  # KV receiver: a KV_WRITE meta; the payload length is all we claim
        frame = _frame(wire.FrameType.KV_WRITE, app[:wire.MAX_META_BYTES], rng.choice((0, 1, 64, 2**40)))
    if rng.random() < 0.3:  # mostly refused by the header CRC (transport v2)
        frame = mutate(rng, frame, [frame])
    return frame


def _insider(rng: random.Random, target: FuzzTarget, num: int) -> int:
    """Up to `num` frames on one authenticated connection (until the server drops it); returns how many."""
    try:
        stream = _authenticated(target)
    except DisaggError:
        return 0
    sent = 0
    try:
        while sent < num:
            frame = _post_auth_frame(rng, target)
            try:
                stream.sock.sendall(frame)
            except OSError:
                break
            sent += 1
            if _closed_by_peer(stream.sock):
                break
    finally:
        stream.close()
    return sent


def _closed_by_peer(sock: socket.socket) -> bool:
    """Drain replies without blocking; True when the server hung up."""
    sock.settimeout(0.002)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
            if len(data) < 65536:
                return False
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def _alive(target: FuzzTarget) -> tuple[bool, str]:
    if target.pid is not None:
        try:
            os.kill(target.pid, 0)
        except ProcessLookupError:
            return False, f"process {target.pid} is gone"
    try:
        if target.probe is not None:
            return (True, "") if target.probe() else (False, "the probe got no valid answer")
        _authenticated(target).close()
        return True, ""
    except (DisaggError, OSError) as err:
        return False, f"{type(err).__name__}: {err}"


def fuzz_port(target: FuzzTarget, num_frames: int, seed: int = 0, post_auth: bool = True,
              check_every: int = 500, deadline_s: float = 600.0) -> FuzzResult:
    """Send `num_frames` fuzzed frames to one port (half strangers, half insiders when `post_auth`)."""
    rng = random.Random(seed)
    res = FuzzResult(target.name)
    t0 = time.monotonic()
    next_check = check_every
    while res.num_frames < num_frames and time.monotonic() - t0 < deadline_s:
        try:
            if post_auth and rng.random() < 0.5:
                n = _insider(rng, target, min(64, num_frames - res.num_frames))
                res.num_post_auth += n
                res.num_frames += max(n, 1)
            else:
                _stranger(rng, target)
                res.num_pre_auth += 1
                res.num_frames += 1
        except (DisaggError, OSError) as err:  # refused (wire.connect_socket: PeerLostError): the listener may be gone
            ok, why = _alive(target)
            if not ok:
                _record_crash(res, f"{why} (after {err!r})")
                break
        if res.num_frames >= next_check:
            next_check += check_every
            if not _probe(res, target):
                break
    _probe(res, target)
    res.seconds = round(time.monotonic() - t0, 3)
    return res


def _probe(res: FuzzResult, target: FuzzTarget) -> bool:
    res.num_probes += 1
    ok, why = _alive(target)
    if not ok:
        res.failed_probes += 1
        _record_crash(res, why)
    return ok


def _record_crash(res: FuzzResult, why: str) -> None:
    res.server_crashes_from_bad_input = 1  # a port that stopped serving counts once
    res.first_failure = res.first_failure or why


# ---- seeds ------------------------------------------------------------------------------------
def side_channel_seeds() -> list[bytes]:
    """Valid KV side-channel messages (REGISTER with a trace context, CANCEL, ACCEPT)."""
    from vllm_disagg.kv.handshake import HandshakeInfo, MsgType, SideMsg, encode_msg, handshake_body
    from vllm_disagg.observe.context import TraceContext

    info = HandshakeInfo("m", "float32", 16, "cpu:float32(2, 16, 8)", 2, 2, 4, 1024)
    body = {**handshake_body(info, "wrong-token", "fuzz-tid"), "address": "127.0.0.1:1", "start_block": 0,
            "num_prompt_tokens": 40, "push_timeout_s": 1.0}
    trace = TraceContext(bytes(range(1, 17)), bytes(range(1, 9)), 1)
    msgs = [encode_msg(SideMsg(MsgType.REGISTER, body, (1, 2, 3), trace)),
            encode_msg(SideMsg(MsgType.CANCEL, {"transfer_id": "fuzz-tid", "reason": "fuzz"})),
            encode_msg(SideMsg(MsgType.ACCEPT, {"transfer_id": "x"})), struct.pack("!4sH", b"DGKV", 1)]
    return [(m, []) for m in msgs]


def kv_write_seeds() -> list[bytes]:
    import numpy as np

    from vllm_disagg.transport.kv_common import pack_write_meta

    return [(pack_write_meta(s, 0, 1, 0, r, b"fuzz-tid", np.asarray(ids, dtype="<u4")), [])
            for s, r, ids in ((1, 0, [0, 1]), (2, 1, [5]), (3, 0, []), (4, 7, [2**31]))]


def attention_seeds(num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 32, block_size: int = 16) -> list:
    """Valid attention-server messages: INIT (with a trace), PING, a step's ATTN with metadata and
    registrations, QPREV/KV, RESTORE and CLAIM."""
    import torch

    from vllm_disagg.attention import wire as lama
    from vllm_disagg.observe.context import TraceContext

    geom = lama.Geometry(2, num_heads, num_kv_heads, head_size, block_size, "float32", 64)
    trace = TraceContext(bytes(range(1, 17)), bytes(range(1, 9)), 1).to_bytes()
    n = 4
    step = lama.StepMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                         torch.tensor([[1]], dtype=torch.int32), torch.arange(block_size, block_size + n))
    meta = [lama.byte_view(t).tobytes() for t in step.tensors()]
    q, kv = bytes(n * num_heads * head_size * 4), bytes(n * num_kv_heads * head_size * 4)
    ids, keys = lama.byte_view(torch.tensor([1, 2], dtype=torch.int32)).tobytes(), bytes(range(32))
    hdr = dict(layer=0, meta_id=5, num_tokens=n, num_reqs=1, num_cols=1, scale=0.1)
    H = lama.Header
    return [
        (H(lama.INIT, seq=1, flags=lama.HAS_TRACE).pack(), [geom.to_json(), trace]),
        (H(lama.PING, seq=2).pack(), []),
        (H(lama.ATTN, seq=3, flags=lama.HAS_META | lama.HAS_REG | lama.HAS_TRACE, **hdr).pack(),
         [q, kv, kv, *meta, ids, keys, trace]),
        (H(lama.ATTN, seq=4, **hdr).pack(), [q, kv, kv]),
        (H(lama.QPREV, seq=5, flags=lama.HAS_META, **{**hdr, "meta_id": 6}).pack(), [q, *meta]),
        (H(lama.KV, seq=6, **{**hdr, "meta_id": 6}).pack(), [kv, kv]),
        (H(lama.RESTORE, seq=7).pack(), [ids, keys]),
        (H(lama.CLAIM, seq=8, flags=lama.HAS_REG).pack(), [ids, ids, keys]),
    ]
