# SPDX-License-Identifier: Apache-2.0
"""Attention-server loss: reconnect, then rebuild every running request's KV by recompute.

Lamina keeps all request state on the attention workers; when one dies, its KV is rebuilt "from
the prompt text and the generated tokens". Here the model worker does it in place, inside the
step that hit the failure (`DisaggAttentionRunner._model_forward`):

1. `reconnect`: wait a short grace period for every configured server to answer `/health` (a
   replacement started at the same address counts). Continue with the servers that answer: any
   set for request-wise, a set whose size divides the KV heads for head-wise; else fail the step.
   Re-INIT re-shards the heads over the new set.
2. `rebuild_kv`: for each request in the persistent batch, run the model once over its first
   `num_computed_tokens` tokens (prompt + generated so far) with its own block table; the remote
   backend writes that KV into the servers. Then the interrupted step is run again (rewriting
   the KV of layers that had already succeeded is idempotent).

Requests therefore survive with no client-visible error. Not covered: a loss inside a
nano-batched (pipelined) step fails the step (the engine reports the error; nothing hangs), and
the servers left must hold the scheduler's number of blocks (leave headroom for a loss, or
start a replacement at the lost address within `REPLACEMENT_WAIT_S`).
"""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_disagg.attention.client import AttentionServerLost, ClientMeta, DisaggAttentionClient, ServerConn
from vllm_disagg.attention.wire import StepMeta

logger = init_logger(__name__)
REPLACEMENT_WAIT_S = 5.0


def healthy(http_addr: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_addr}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def reconnect(client: DisaggAttentionClient, required_blocks: int, wait_s: float = REPLACEMENT_WAIT_S) -> list[str]:
    """Reconnect to the servers that are up (see module doc); returns their addresses.

    `required_blocks` is the scheduler's block count: fewer servers may hold fewer blocks each
    (head-wise: each takes more heads), which only works if the deployment left that headroom
    (e.g. `num_gpu_blocks_override`)."""
    addrs = client.configured
    deadline = time.monotonic() + wait_s
    live = [a for a in addrs if healthy(a)]
    while len(live) < len(addrs) and time.monotonic() < deadline:
        time.sleep(0.2)
        live = [a for a in addrs if healthy(a)]
    if not live:
        raise AttentionServerLost(",".join(addrs), RuntimeError("no attention server is reachable"))
    client.close()
    client.conns = [ServerConn(a, client.transport, client.timeout_s) for a in live]
    if client.placer is not None:
        client.placer = type(client.placer)(len(live))
    new_blocks = client.connect(**client.geometry_args)
    if new_blocks < required_blocks:
        raise AttentionServerLost(",".join(live), RuntimeError(
            f"surviving servers hold {new_blocks} blocks, the scheduler uses {required_blocks}; start a "
            "replacement at the lost address or leave headroom (num_gpu_blocks_override)"))
    client.num_recoveries += 1
    logger.warning("remote attention: continuing on %d/%d servers %s", len(live), len(addrs), live)
    return live


def rebuild_kv(runner, attn_layer_names: list[str]) -> int:
    """Recompute the KV of every request in the runner's batch; returns the number of tokens."""
    from vllm.forward_context import create_forward_context, override_forward_context

    ib = runner.input_batch
    bs = runner.cache_config.block_size
    table = ib.block_table[0].get_numpy_array()
    total = 0
    for i, req_id in enumerate(ib.req_ids):
        n = int(ib.num_computed_tokens_cpu[i])
        if n == 0:
            continue  # nothing computed yet: this step prefills it
        blocks = torch.from_numpy(np.ascontiguousarray(table[i, : -(-n // bs)])).to(torch.int32)
        pos = torch.arange(n)
        step = StepMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                        blocks[None].contiguous(), (blocks[pos // bs].long() * bs + pos % bs).contiguous())
        meta = ClientMeta(step, max_query_len=n, num_actual_tokens=n)
        ids = torch.from_numpy(ib.token_ids_cpu[i, :n].astype(np.int64))
        ctx = create_forward_context(dict.fromkeys(attn_layer_names, meta), runner.vllm_config)
        with override_forward_context(ctx), torch.inference_mode():
            runner.model(input_ids=ids, positions=pos)
        total += n
        logger.info("remote attention: rebuilt %d tokens of request %s", n, req_id)
    return total


def forget_splits(attn_metadata) -> None:
    """Request-wise splits of the current step point at old server indices: recompute them."""
    metas = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
    for group in metas:
        for m in (group or {}).values():
            if isinstance(m, ClientMeta):
                m._splits = None
