# SPDX-License-Identifier: Apache-2.0
"""nixl KV receiver, the sender's goodbye: a BYE announces how many writes the sender issued, so
notifications that trail it are still accepted (the suite's close-right-after-DONE case), and
writes that never arrive make the sender lost after `timeout_s` instead of vanishing silently."""

from __future__ import annotations

import time

import pytest
import torch

from vllm_disagg.transport import TransportOptions, get_transport, transport_class
from vllm_disagg.transport.nixl.agent import KV_SERVICE, pack_bye
from vllm_disagg.transport.wire import T_BYE, SockStream, client_handshake, connect_socket, pack_frame

TOKEN = "goodbye-token"
TIMEOUT_S = 1.0

pytestmark = pytest.mark.skipif(
    transport_class("nixl").unavailable_reason() is not None, reason="nixl cannot run here"
)


@pytest.fixture
def rx():
    rx = get_transport("nixl", TransportOptions(auth_token=TOKEN, timeout_s=TIMEOUT_S)).kv_receiver(
        name="decode"
    )
    rx.register_region("layer.0", torch.zeros(4, 256))
    rx.start()
    yield rx
    rx.close()


def _say_goodbye(address: str, name: str, bye_meta: bytes) -> None:
    """A sender's control connection by hand: authenticate, then BYE (its agent never writes)."""
    stream = SockStream(connect_socket(address, 10), address, 10)
    client_handshake(stream, TOKEN.encode(), KV_SERVICE, f"vd-no-such-agent-{name}\n{name}".encode())
    stream.send_parts([pack_frame(T_BYE, bye_meta)])
    time.sleep(0.1)
    stream.close()


def _lost_within(rx, seconds: float) -> list[str]:
    deadline, lost = time.monotonic() + seconds, []
    while not lost and time.monotonic() < deadline:
        lost = rx.lost_peers()
        time.sleep(0.05)
    return lost


def test_a_goodbye_whose_writes_never_arrive_makes_the_sender_lost_after_the_timeout(rx):
    t0 = time.monotonic()
    _say_goodbye(rx.address, "liar", pack_bye(2))
    assert _lost_within(rx, 10 * TIMEOUT_S) == ["liar"]
    assert time.monotonic() - t0 >= TIMEOUT_S  # it waited for the trailing notifications first


@pytest.mark.parametrize("bye_meta", [pack_bye(0), b""], ids=["all-notified", "without-count"])
def test_a_goodbye_with_nothing_outstanding_is_clean(rx, bye_meta):
    _say_goodbye(rx.address, "done", bye_meta)
    assert _lost_within(rx, 1.5 * TIMEOUT_S) == []  # a misread goodbye would expire in TIMEOUT_S


def test_a_malformed_goodbye_is_a_loss_not_a_clean_close(rx):
    _say_goodbye(rx.address, "garbled", b"xyz")
    assert _lost_within(rx, 10 * TIMEOUT_S) == ["garbled"]
