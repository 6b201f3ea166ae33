# SPDX-License-Identifier: Apache-2.0
"""CANCEL to a prefill instance whose push lost its decode half before D registered for it.

P keeps a finished prefill's blocks until D registers (then pushes) or `push_timeout_s` passes. D
sends CANCEL itself when its request is aborted while it waits, but a decode half the router cut
(D stalled, SIGSTOPped or dead) never reaches D's receiver: found by the adaptive chaos soak, where
P held six such pushes' blocks for the 30 s registration timeout. So when the router gives up on a
decode half after P answered, it sends P the same CANCEL (kv/handshake.py, MsgType.CANCEL) on P's
side channel, signed with the deployment's shared token, in the background and bounded.

TP > 1 prefill instances serve one side channel per rank (kv_port + rank); the router knows only
kv_port, so it cancels rank 0, which passes the CANCEL on to its other ranks (kv/push_sender.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from vllm_disagg.errors import DisaggError
from vllm_disagg.kv.handshake import MsgType, cancel_msg, decode_msg
from vllm_disagg.kv.side_channel import call_once
from vllm_disagg.transport import TransportOptions, get_transport

logger = logging.getLogger(__name__)


class PushCanceller:
    """Best effort: a prefill instance that is gone or slow costs one bounded thread call."""

    def __init__(self, token: str, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._control = get_transport("tcp", TransportOptions(auth_token=token, timeout_s=timeout_s))
        self._tasks: set[asyncio.Future] = set()
        self.num_sent = 0
        self.num_acked = 0

    def cancel_later(self, decode_body: dict[str, Any], reason: str) -> None:
        """CANCEL the push named by D's `kv_transfer_params` (transfer_id, remote_host, remote_port)."""
        params = decode_body.get("kv_transfer_params") or {}
        transfer_id, host, port = params.get("transfer_id"), params.get("remote_host"), params.get("remote_port")
        if not (transfer_id and host and port):
            return
        task = asyncio.ensure_future(asyncio.to_thread(self._cancel, f"{host}:{port}", str(transfer_id), reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel(self, address: str, transfer_id: str, reason: str) -> bool:
        self.num_sent += 1
        try:
            raw = call_once(self._control.connect_msg, address, cancel_msg(transfer_id, reason), self.timeout_s)
            reply = decode_msg(raw, address)
        except (DisaggError, OSError) as err:
            logger.info("KV push %s: CANCEL to prefill %s not delivered (%s); it frees the blocks at its "
                        "push timeout", transfer_id, address, err)
            return False
        acked = reply.type is MsgType.CANCEL_ACK
        self.num_acked += acked
        logger.info("KV push %s: cancelled on prefill %s (%s)", transfer_id, address, reason)
        return acked

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
