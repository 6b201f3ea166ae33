# SPDX-License-Identifier: Apache-2.0
"""A vLLM worker extension that reports what each rank's KV connector did (tests only).

With tensor parallelism the connector's worker half lives in the worker processes, out of the
test's reach: `LLM(..., worker_extension_cls=KV_PROBE)` adds `disagg_kv_probe`, which
`llm.collective_rpc("disagg_kv_probe")` calls on every rank.
"""

from __future__ import annotations

KV_PROBE = "vllm_disagg.testing.kv_probe.KVProbe"


class KVProbe:
    def disagg_kv_probe(self) -> dict:
        """This rank's side-channel and receiver addresses, finished pushes and landed receives."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        worker = get_kv_transfer_group().connector_worker
        sender, receiver = worker.sender, worker.receiver
        return {
            "rank": worker.rank,
            "sender_address": getattr(sender, "address", None),
            "pushes": [dict(p) for p in getattr(sender, "timeline", [])],
            "receiver_address": getattr(receiver, "address", None),
            "num_landed": getattr(receiver, "num_landed", 0),
        }
