# SPDX-License-Identifier: Apache-2.0
"""The framed, versioned binary wire format shared by the stream backends (tcp, shm, nixl control).

Every frame is `FRAME_HDR` (magic, version, type, meta_len, payload_len) + `meta` (type-specific,
bounded by MAX_META_BYTES) + `payload` (raw bytes, checked against what the type allows). Nothing
is pickled. A connection starts with a mutual HMAC-SHA256 challenge over the shared token:

    server -> CHALLENGE(server_nonce)
    client -> AUTH(client_nonce, mac_c = HMAC(token, "c"|service|server_nonce|client_nonce), hello)
    server -> WELCOME(mac_s = HMAC(token, "s"|service|client_nonce|server_nonce), info)   or ERROR

`service` (b"kv", b"msg", ...) binds a MAC to one use so a proof cannot be replayed elsewhere.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import select
import socket
import struct
import sys
import zlib
from collections.abc import Sequence
from typing import Any

from vllm_disagg.errors import AuthError, PeerLostError, ProtocolError, TransportTimeout

# Version history of the wire protocol (bump on any incompatible change):
#   1: initial: CHALLENGE/AUTH/WELCOME handshake, KV_WRITE, MSG, ERROR, BYE.
#      (Frame types became the `FrameType` enum with the KV side channel's v2 and attention's v4:
#      no byte changed here, so this stays 1. CANCEL and trace context live in those formats.)
#   2: the header ends with a CRC32 over the header and the meta. A flipped byte in a KV_WRITE's
#      destination (layer, block ids) landed KV in another request's blocks, which KV verification
#      (a CRC of the payload, transport/checksum.py) cannot see; now the frame is refused before use.
PROTOCOL_VERSION = 2
MAGIC = b"VDTP"
FRAME_HDR = struct.Struct("<4sHHIQI")  # magic, version, type, meta_len, payload_len, crc32(header..., meta)
_HDR_FIELDS = struct.Struct(FRAME_HDR.format[:-1])  # the header before its CRC
_CRC = struct.Struct("<I")
MAX_META_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 10
MAX_TENSORS = 256
NONCE_BYTES = 32
MAC_BYTES = 32
SEND_IOV_MAX = 512



class FrameType(enum.IntEnum):
    CHALLENGE = 1
    AUTH = 2
    WELCOME = 3
    ERROR = 4
    BYE = 5
    KV_WRITE = 10
    MSG = 20
    SHM_SETUP = 30  # shm: carries memfd/eventfds (SCM_RIGHTS) right after WELCOME


T_CHALLENGE, T_AUTH, T_WELCOME, T_ERROR, T_BYE = (FrameType.CHALLENGE, FrameType.AUTH, FrameType.WELCOME,
                                                  FrameType.ERROR, FrameType.BYE)
T_KV_WRITE, T_MSG, T_SHM_SETUP = FrameType.KV_WRITE, FrameType.MSG, FrameType.SHM_SETUP
_BY_VALUE = FrameType._value2member_map_

ERR_PROTOCOL, ERR_AUTH = b"P", b"A"  # ERROR frame codes

# KV_WRITE meta: seq, chunk_idx, num_chunks, layer, region_idx, num_blocks, tid_len; tid; u32 ids.
KV_WRITE_META = struct.Struct("<QIIiIIH")
MAX_TID_BYTES = 128


def as_byte_view(obj: Any) -> memoryview:
    """A flat, writable-if-possible byte view over a tensor's or buffer's own memory (no copy).

    Hot on every message (16 KiB round trip, issue 7): exact-type checks come first because
    `isinstance(x, torch.Tensor)` goes through torch's metaclass (~1 us), and `detach()` is paid
    only for tensors that require grad."""
    kind = type(obj)
    if kind is memoryview and obj.ndim == 1 and obj.format == "B":
        return obj  # hot path: already a byte view
    if kind is bytes:
        return memoryview(obj)
    torch = sys.modules.get("torch")
    if torch is not None and (kind is torch.Tensor or isinstance(obj, torch.Tensor)):
        if not obj.is_cpu:
            raise ValueError(f"tensor on {obj.device} needs a host staging buffer for this backend")
        if not obj.is_contiguous():
            raise ValueError(f"tensor {tuple(obj.shape)} is not contiguous; pass .contiguous()")
        if obj.requires_grad:
            obj = obj.detach()
        try:
            arr = obj.numpy()
        except TypeError:  # dtypes numpy lacks (bfloat16, fp8): reinterpret the bytes
            arr = obj.reshape(-1).view(torch.uint8).numpy()
        return memoryview(arr).cast("B") if arr.ndim != 1 or arr.itemsize != 1 else memoryview(arr)
    view = memoryview(obj)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    return view.cast("B")


def pack_frame(ftype: int, meta: bytes = b"", payload_len: int = 0) -> bytes:
    return frame_head(ftype, meta, payload_len) + meta


def frame_head(ftype: int, meta: bytes | bytearray | memoryview, payload_len: int, *, magic: bytes = MAGIC,
               version: int = PROTOCOL_VERSION) -> bytes:
    """The header of a frame with this meta (its CRC covers both); `magic`/`version` for fuzzers."""
    fields = _HDR_FIELDS.pack(magic, version, ftype, len(meta), payload_len)
    return fields + _CRC.pack(zlib.crc32(meta, zlib.crc32(fields)))


def check_frame_crc(raw: bytes | bytearray | memoryview, meta: bytes | bytearray | memoryview, peer: str) -> None:
    """Refuse a frame whose header or meta changed on the way (before any field of the meta is used)."""
    (crc,) = _CRC.unpack_from(raw, _HDR_FIELDS.size)
    if crc != zlib.crc32(meta, zlib.crc32(raw[: _HDR_FIELDS.size])):
        raise ProtocolError(f"frame from {peer} fails its header CRC (a byte of its header or meta changed "
                            "on the way): dropping the connection")


def parse_frame_header(raw: bytes | bytearray | memoryview, peer: str) -> tuple[FrameType, int, int]:
    """Check magic, version, type and meta size; return (type, meta_len, payload_len). The caller
    reads the meta, then calls `check_frame_crc` before using it."""
    magic, version, ftype, meta_len, payload_len, _ = FRAME_HDR.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} from {peer} (expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:  # a frame, not a handshake field: the connection is dropped
        raise ProtocolError(f"frame from {peer} has transport protocol version {version}, this side speaks "
                            f"{PROTOCOL_VERSION}: run the same vllm-disagg version on both ends")
    ftype = _BY_VALUE.get(ftype)
    if ftype is None:
        raise ProtocolError(f"unknown frame type {FRAME_HDR.unpack(raw)[2]} from {peer}")
    if meta_len > MAX_META_BYTES:
        raise ProtocolError(f"frame meta of {meta_len} bytes from {peer} exceeds {MAX_META_BYTES}")
    return ftype, meta_len, payload_len


class SockStream:
    """Exact-length send/recv over a connected socket, with timeouts and clean peer errors.

    The socket stays in blocking mode with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) rather than
    Python's timeout mode (a non-blocking fd + poll per call): a multi-MiB payload then lands in one
    `recv_into(..., MSG_WAITALL)` and leaves in one `sendmsg`, with no Python loop per 64 KiB.
    """

    def __init__(self, sock: socket.socket, peer: str, timeout: float):
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        self._applied: float | None = None
        sock.settimeout(None)

    def send_parts(self, parts: Sequence[Any], timeout: float | None = None) -> int:
        """sendmsg() all parts (zero-copy from their memory); returns bytes sent. Usually one
        sendmsg takes everything; a partial send resumes where the kernel stopped."""
        views = [as_byte_view(p) for p in parts]
        total = sum([v.nbytes for v in views])
        try:
            self._settimeout(timeout)
            sent = self.sock.sendmsg(views[:SEND_IOV_MAX]) if views else 0
            if sent != total:
                self._send_rest(views, sent)
        except (TimeoutError, BlockingIOError):
            raise TransportTimeout(f"send to {self.peer} blocked longer than {self._applied}s") from None
        except OSError as err:
            raise PeerLostError(f"connection to {self.peer} lost during send: {err}") from None
        return total

    def _send_rest(self, views: list[memoryview], sent: int) -> None:
        """Finish a partial sendmsg: drop the `sent` bytes already gone, send the rest."""
        i = 0
        while i < len(views):
            while sent and i < len(views):
                if sent >= views[i].nbytes:
                    sent -= views[i].nbytes
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
            if i < len(views):
                sent = self.sock.sendmsg(views[i : i + SEND_IOV_MAX])

    def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        n = view.nbytes
        if not n:
            return
        try:
            self._settimeout(timeout)
            got = self.sock.recv_into(view, n, socket.MSG_WAITALL)  # usually all of it at once
            if got == 0:
                raise PeerLostError(f"{self.peer} closed the connection (0/{n} bytes of a frame read)")
            while got < n:
                k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
                if k == 0:
                    raise PeerLostError(
                        f"{self.peer} closed the connection ({got}/{n} bytes of a frame read)"
                    )
                got += k
        except (TimeoutError, BlockingIOError):
            raise TransportTimeout(f"no data from {self.peer} within {self._applied}s") from None
        except OSError as err:
            raise PeerLostError(f"connection to {self.peer} lost during recv: {err}") from None

    def recv_some_into(self, view: memoryview, wait_s: float) -> int:
        """Fill `view` as far as the bytes that come within `wait_s` go; returns how many (0: none came).
        One MSG_WAITALL call either way, so a payload already here lands in one call."""
        n = view.nbytes
        try:
            self._settimeout(wait_s)
            got = self.sock.recv_into(view, n, socket.MSG_WAITALL)
        except (TimeoutError, BlockingIOError):
            return 0
        except OSError as err:
            raise PeerLostError(f"connection to {self.peer} lost during recv: {err}") from None
        if got == 0 and n:
            raise PeerLostError(f"{self.peer} closed the connection (0/{n} bytes of a frame read)")
        return got

    def recv_exact(self, n: int, timeout: float | None = None) -> bytearray:
        buf = bytearray(n)
        self.recv_into(memoryview(buf), timeout)
        return buf

    def peer_closed(self) -> bool:
        """Non-blocking check whether the peer has hung up (or sent something unexpected)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            return bool(readable) and self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _settimeout(self, timeout: float | None) -> None:
        want = self.timeout if timeout is None else timeout
        if self._applied != want:
            sec = int(want)
            tv = struct.pack(
                "ll", sec, max(1, int((want - sec) * 1e6)) if sec == 0 else int((want - sec) * 1e6)
            )
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._applied = want


def read_frame(stream: SockStream, timeout: float | None = None) -> tuple[FrameType, bytearray, int]:
    """Read one frame header + meta; return (type, meta, payload_len). ERROR frames raise."""
    raw = stream.recv_exact(FRAME_HDR.size, timeout)
    ftype, meta_len, payload_len = parse_frame_header(raw, stream.peer)
    meta = stream.recv_exact(meta_len, timeout) if meta_len else bytearray()
    check_frame_crc(raw, meta, stream.peer)
    if ftype == T_ERROR:
        code, text = bytes(meta[:1]), bytes(meta[1:513]).decode("utf-8", "replace")
        raise (AuthError if code == ERR_AUTH else ProtocolError)(f"{stream.peer} reported: {text}")
    return ftype, meta, payload_len


def send_error(stream: SockStream, err: Exception) -> None:
    """Best effort: tell the peer why we drop it (ERROR meta = 1-byte code + UTF-8 text)."""
    code = ERR_AUTH if isinstance(err, AuthError) else ERR_PROTOCOL
    try:
        stream.send_parts([pack_frame(T_ERROR, code + str(err).encode()[:512])], timeout=1.0)
    except Exception:  # the peer may already be gone; we are dropping it anyway
        pass


def _mac(token: bytes, side: bytes, service: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(token, side + b"|" + service + b"|" + a + b, hashlib.sha256).digest()


def server_handshake(stream: SockStream, token: bytes, service: bytes, welcome_info_fn) -> bytes:
    """Authenticate a client; returns its hello bytes. `welcome_info_fn(hello) -> bytes`."""
    server_nonce = os.urandom(NONCE_BYTES)
    stream.send_parts([pack_frame(T_CHALLENGE, server_nonce)])
    ftype, meta, payload_len = read_frame(stream)
    if ftype != T_AUTH or payload_len or len(meta) < NONCE_BYTES + MAC_BYTES:
        raise ProtocolError(f"expected AUTH from {stream.peer}, got type {ftype} ({len(meta)} meta bytes)")
    client_nonce, mac_c = bytes(meta[:NONCE_BYTES]), bytes(meta[NONCE_BYTES : NONCE_BYTES + MAC_BYTES])
    if not hmac.compare_digest(mac_c, _mac(token, b"c", service, server_nonce, client_nonce)):
        raise AuthError(f"peer {stream.peer} failed authentication for service {service.decode()!r}")
    hello = bytes(meta[NONCE_BYTES + MAC_BYTES :])
    info = welcome_info_fn(hello)
    mac_s = _mac(token, b"s", service, client_nonce, server_nonce)
    stream.send_parts([pack_frame(T_WELCOME, mac_s + info)])
    return hello


def client_handshake(stream: SockStream, token: bytes, service: bytes, hello: bytes) -> bytes:
    """Authenticate to a server (and it to us); returns the server's welcome info."""
    ftype, meta, payload_len = read_frame(stream)
    if ftype != T_CHALLENGE or len(meta) != NONCE_BYTES or payload_len:
        raise ProtocolError(f"expected CHALLENGE from {stream.peer}, got type {ftype}")
    server_nonce, client_nonce = bytes(meta), os.urandom(NONCE_BYTES)
    mac_c = _mac(token, b"c", service, server_nonce, client_nonce)
    stream.send_parts([pack_frame(T_AUTH, client_nonce + mac_c + hello)])
    ftype, meta, payload_len = read_frame(stream)
    if ftype != T_WELCOME or len(meta) < MAC_BYTES or payload_len:
        raise ProtocolError(f"expected WELCOME from {stream.peer}, got type {ftype}")
    if not hmac.compare_digest(
        bytes(meta[:MAC_BYTES]), _mac(token, b"s", service, client_nonce, server_nonce)
    ):
        raise AuthError(f"server {stream.peer} failed to prove the shared token")
    return bytes(meta[MAC_BYTES:])


def parse_address(address: str) -> tuple[int, Any]:
    """'host:port' -> (AF_INET, (host, port)); '@name' -> (AF_UNIX, abstract name)."""
    if address.startswith("@"):
        return socket.AF_UNIX, "\0" + address[1:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad transport address {address!r}: expected HOST:PORT or @unix-name")
    return socket.AF_INET, (host, int(port))


def connect_socket(address: str, timeout: float) -> socket.socket:
    family, addr = parse_address(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(addr)
    except TimeoutError:
        sock.close()
        raise TransportTimeout(f"connect to {address} timed out after {timeout}s") from None
    except OSError as err:
        sock.close()
        raise PeerLostError(f"cannot connect to {address}: {err}") from None
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
