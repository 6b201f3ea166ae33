# SPDX-License-Identifier: Apache-2.0
"""`tcp` backend (the default): authenticated, framed TCP with several streams per KV peer.

Bytes go from tensor memory to the socket with one sendmsg per chunk (iovecs over the source
blocks) and from the socket into the destination blocks with recv_into; nothing is staged.
"""

from __future__ import annotations

from vllm_disagg.transport.base import MsgChannel, Transport, TransportKind
from vllm_disagg.transport.msg import SockMsgListener, StreamMsgChannel
from vllm_disagg.transport.stream.rx import StreamKVReceiver
from vllm_disagg.transport.stream.tx import StreamKVSender
from vllm_disagg.transport.wire import SockStream, client_handshake, connect_socket

__all__ = ["TcpTransport", "connect_msg_stream"]


def connect_msg_stream(address: str, token: str, timeout: float) -> SockStream:
    """Connect and authenticate a message stream (tcp `host:port` or shm `@name`)."""
    stream = SockStream(connect_socket(address, timeout), address, timeout)
    try:
        client_handshake(stream, token.encode(), b"msg", b"")
    except BaseException:
        stream.close()
        raise
    return stream


class TcpTransport(Transport):
    kind = TransportKind.TCP
    DOCTOR_NOTE = "default"
    receiver_cls = StreamKVReceiver
    sender_cls = StreamKVSender
    listener_cls = SockMsgListener

    def connect_msg(self, address: str, timeout: float | None = None) -> MsgChannel:
        timeout = self.options.timeout_s if timeout is None else timeout
        stream = connect_msg_stream(address, self.options.auth_token, timeout)
        stream.timeout = self.options.timeout_s
        return StreamMsgChannel(stream, self.options)
