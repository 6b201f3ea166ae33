# SPDX-License-Identifier: Apache-2.0
"""The router's CANCEL to a prefill instance whose decode half it gave up on, against the real
prefill side channel (`PushSender` over tcp, no engine: the test plays the engine's part)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import torch
from test_admission import _until
from test_router_proxy import _post, deployment, run

from vllm_disagg.config import KVTransferSection
from vllm_disagg.kv.handshake import HandshakeInfo
from vllm_disagg.kv.metadata import DisaggConnectorMetadata, SaveSpec
from vllm_disagg.kv.push_sender import PushSender
from vllm_disagg.kv.stats import DisaggKVConnectorStats
from vllm_disagg.router.push_cancel import PushCanceller
from vllm_disagg.transport import TransportOptions, get_transport

BS, NUM_LAYERS = 16, 2
INFO = HandshakeInfo(model="m", dtype="float32", block_size=BS, kv_layout="cpu:float32(2, 16, 8)",
                     num_layers=NUM_LAYERS, num_kv_heads=2, head_size=4, block_nbytes=2 * BS * 8 * 4)


def _prefill_side_channel(info: HandshakeInfo = INFO, port: int = 0) -> PushSender:
    layers = [torch.randn(8, 2, BS, 8) for _ in range(NUM_LAYERS)]
    control = get_transport("tcp", TransportOptions(auth_token="tok", timeout_s=5.0, port=port))
    return PushSender(control, get_transport("tcp", TransportOptions(auth_token="tok", timeout_s=5.0)),
                      info, "tok", layers, KVTransferSection(push_timeout_s=30.0),
                      (DisaggKVConnectorStats(), threading.Lock()))


def _prefill_waiting_for_decode(transfer_id: str, info: HandshakeInfo = INFO, port: int = 0) -> PushSender:
    """A prefill instance whose request `p1` finished and now waits (30 s) for D to register."""
    sender = _prefill_side_channel(info, port)
    sender.bind(DisaggConnectorMetadata(save_specs=[SaveSpec("p1", (1, 2), 40, 40, transfer_id, True)]))
    for layer in range(NUM_LAYERS):
        sender.layer_saved(layer)
    sender.bind(DisaggConnectorMetadata(release_req_ids=["p1"]))
    return sender


def _decode_body(transfer_id: str, address: str) -> dict:
    host, port = address.rsplit(":", 1)
    return {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id,
                                                  "remote_host": host, "remote_port": int(port)}}


async def _cancel(canceller: PushCanceller, *bodies: dict) -> None:
    for body in bodies:
        canceller.cancel_later(body, "the router gave up on the decode half")
    await canceller.stop()


def test_a_cut_decode_half_frees_the_prefill_blocks_at_once_not_at_the_push_timeout():
    sender = _prefill_waiting_for_decode("t-cut")
    try:
        assert sender.finished_sending() == set()  # held: D has not registered
        t0 = time.monotonic()
        canceller = PushCanceller("tok")
        asyncio.run(_cancel(canceller, _decode_body("t-cut", sender.address)))
        assert canceller.num_acked == 1
        deadline = time.monotonic() + 10
        while not (done := sender.finished_sending()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert done == {"p1"} and time.monotonic() - t0 < 10  # not its push_timeout_s (30 s)
    finally:
        sender.close()


def _two_free_ports() -> int:
    """A port p with p + 1 free too: a TP=2 prefill instance's ranks listen on kv_port + rank."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


def test_rank_0_of_a_tp_prefill_instance_passes_the_cancel_on_to_its_other_ranks():
    """The router knows only kv_port (rank 0); rank 1 holds its own KV-head slice of the push's blocks
    and, before, kept them for its 30 s push timeout."""
    port = _two_free_ports()
    ranks = [_prefill_waiting_for_decode("t-tp", dataclasses.replace(INFO, tp_size=2, tp_rank=rank), port + rank)
             for rank in range(2)]
    try:
        t0 = time.monotonic()
        canceller = PushCanceller("tok")
        asyncio.run(_cancel(canceller, _decode_body("t-tp", ranks[0].address)))
        assert canceller.num_sent == 1 and canceller.num_acked == 1  # one CANCEL, to rank 0 only
        for sender in ranks:
            deadline = time.monotonic() + 10
            while not (done := sender.finished_sending()) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert done == {"p1"}
        assert time.monotonic() - t0 < 10  # not the push timeout (30 s)
    finally:
        for sender in ranks:
            sender.close()


def test_a_wrong_token_a_dead_prefill_or_no_kv_params_cost_a_bounded_try_and_never_raise():
    sender = _prefill_waiting_for_decode("t-auth")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
    try:
        stranger = PushCanceller("not-the-token", timeout_s=1.0)
        t0 = time.monotonic()
        asyncio.run(_cancel(stranger, _decode_body("t-auth", sender.address), _decode_body("t-auth", dead),
                            {"prompt": "x"}))  # the last: a plain route, nothing to cancel
        assert stranger.num_sent == 2 and stranger.num_acked == 0 and time.monotonic() - t0 < 8
        time.sleep(0.2)
        assert sender.finished_sending() == set()  # the stranger freed nothing
    finally:
        sender.close()


def test_the_router_cancels_the_push_of_a_decode_half_it_cut_after_prefill_answered(monkeypatch):
    """D stalls before registering (SIGSTOPped, say): the router cuts it and replays the request, and
    P's side channel gets CANCEL for the first attempt's transfer_id (the real listener remembers a
    CANCEL that comes before its request, so the test needs no prefill engine)."""
    monkeypatch.setenv("VLLM_DISAGG_AUTH_TOKEN", "tok")
    sender = _prefill_side_channel()

    async def scenario():
        async with deployment(p_modes=("ok",), d_modes=("stall",), prefill_kv=[sender.address],
                              health_interval_s=0.1, stall_timeout_s=0.5,
                              health_failures_to_drop=100) as (url, session, ps, ds, _, router):
            ds[0].live_stalled_s = 0.0
            await asyncio.sleep(0.3)
            task = asyncio.create_task(_post(session, url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3}))
            await _until(lambda: ds[0].bodies)
            transfer_id = ds[0].bodies[0]["kv_transfer_params"]["transfer_id"]
            ds[0].live_stalled_s = 3.0
            status, _, _ = await asyncio.wait_for(task, 10)
            assert status == 200
            await _until(lambda: transfer_id in sender.plan.cancelled)
            assert "router gave up" in sender.plan.cancelled[transfer_id][0]
            # P records the CANCEL before it answers, so the router counts the ack a moment later
            await _until(lambda: router.proxy.push_cancel.num_acked >= 1)
    try:
        run(scenario())
    finally:
        sender.close()


def test_the_router_cancels_the_push_of_a_request_the_decode_instance_refused(monkeypatch):
    """P prefilled the prompt and waits for D, but D answers 400 (the chaos soak's bad HTTP: max_tokens
    past the model's length passes P, which generates one token, and fails D's validation). P held
    the blocks for its 30 s push timeout; now the router CANCELs the push."""
    monkeypatch.setenv("VLLM_DISAGG_AUTH_TOKEN", "tok")
    sender = _prefill_side_channel()

    async def scenario():
        async with deployment(p_modes=("ok",), d_modes=("reject",), prefill_kv=[sender.address],
                              health_interval_s=0.1) as (url, session, ps, ds, _, router):
            for stream in (False, True):
                status, _, _ = await asyncio.wait_for(_post(session, url, {
                    "model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream}), 10)
                assert status == 400
                transfer_id = ds[0].bodies[-1]["kv_transfer_params"]["transfer_id"]
                await _until(lambda tid=transfer_id: tid in sender.plan.cancelled)
                assert "router gave up" in sender.plan.cancelled[transfer_id][0]
    try:
        run(scenario())
    finally:
        sender.close()
