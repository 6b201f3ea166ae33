# SPDX-License-Identifier: Apache-2.0
"""Attention-server loss: reconnect, then rebuild every running request's KV by recompute.

Lamina keeps all request state on the attention workers; when one dies, its KV is rebuilt "from
the prompt text and the generated tokens". Here the model worker does it in place, inside the
step that hit the failure (`DisaggAttentionRunner._model_forward`); the steps are in README.md.

More: README.md, "recovery.py".
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from vllm.logger import init_logger

from vllm_disagg.attention import backend
from vllm_disagg.attention.client import AttentionServerLost, ClientMeta, DisaggAttentionClient, ServerConn
from vllm_disagg.attention.wire import StepMeta
from vllm_disagg.liveness import beacon

logger = init_logger(__name__)
REPLACEMENT_WAIT_S = 5.0
_POLL_S = 0.2
_MIN_CALL_S = 0.05
MAX_ATTEMPTS = 3
"""Forward attempts per step: a second loss during the rebuild or the retry gets one more round."""


def healthy(http_addr: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_addr}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def answering(addrs: list[str], deadline: float) -> list[str]:
    """The servers whose /health answers 200, asked at once, each call cut at `deadline`. Asked one
    after another with a 1 s timeout each, servers still starting made the wait overshoot
    `replacement_wait_s` (9.88 s against 5 s, stop 44's chaos soak)."""
    timeout_s = min(1.0, max(_MIN_CALL_S, deadline - time.monotonic()))
    with ThreadPoolExecutor(len(addrs), thread_name_prefix="disagg-attn-health") as pool:
        up = list(pool.map(lambda a: healthy(a, timeout_s), addrs))
    return [a for a, ok in zip(addrs, up, strict=True) if ok]


def reconnect(client: DisaggAttentionClient, required_blocks: int, wait_s: float | None = None) -> list[str]:
    """Reconnect to the servers that are up (see module doc); returns their addresses.

    `required_blocks` is the scheduler's block count: fewer servers may hold fewer blocks each
    (head-wise: each takes more heads), which only works if the deployment left that headroom
    (e.g. `num_gpu_blocks_override`)."""
    if wait_s is None:  # remote_attention.replacement_wait_s
        wait_s = getattr(client, "replacement_wait_s", REPLACEMENT_WAIT_S)
    addrs = client.configured
    t0 = time.monotonic()
    deadline = t0 + wait_s
    live = answering(addrs, deadline)
    while len(live) < len(addrs) and time.monotonic() + _POLL_S < deadline:
        time.sleep(_POLL_S)
        live = answering(addrs, deadline)
    if not live:
        raise AttentionServerLost(",".join(addrs), RuntimeError("no attention server is reachable"))
    logger.info("remote attention: %d/%d servers answer /health after %.2f s", len(live), len(addrs),
                time.monotonic() - t0)
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


def rebuild_kv(runner, group_layer_names: list[list[str]]) -> int:
    """Recompute the KV of every request in the runner's batch; returns the number of tokens.
    `group_layer_names[g]`: the layers of KV cache group g, which write through group g's block
    table (a hybrid model's sliding-window and full layers hold different blocks)."""
    from vllm.forward_context import create_forward_context, override_forward_context

    ib = runner.input_batch
    bs = runner.cache_config.block_size
    tables = [ib.block_table[g].get_numpy_array() for g in range(len(group_layer_names))]
    total = 0
    for i, req_id in enumerate(ib.req_ids):
        n = int(ib.num_computed_tokens_cpu[i])
        if n == 0:
            continue  # nothing computed yet: this step prefills it
        pos = torch.arange(n)
        metas = {}
        for table, names in zip(tables, group_layer_names):
            blocks = torch.from_numpy(np.ascontiguousarray(table[i, : -(-n // bs)])).to(torch.int32)
            step = StepMeta(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                            blocks[None].contiguous(), (blocks[pos // bs].long() * bs + pos % bs).contiguous())
            metas.update(dict.fromkeys(names, ClientMeta(step, max_query_len=n, num_actual_tokens=n)))
        ids = torch.from_numpy(ib.token_ids_cpu[i, :n].astype(np.int64))
        ctx = create_forward_context(metas, runner.vllm_config)
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


def recover(runner, err: AttentionServerLost) -> int:
    """Reconnect, then rebuild the KV of the runner's batch; returns the tokens recomputed.

    Runs on the step's caller thread, inside the step's forward context (its split metadata, if
    any, is re-split against the new server set). Meanwhile `/live` reports `recovering_s`
    (`liveness.beacon.recovering`): the router sends new requests elsewhere instead of waiting out
    its stall limit on a step that waits for a replacement server."""
    from vllm.forward_context import get_forward_context

    logger.warning("remote attention: %s; rebuilding the KV by recompute", err)
    ctx = get_forward_context()
    with beacon.recovering():
        t0 = time.monotonic()
        reconnect(_client_of(runner), runner.kv_cache_config.num_blocks)
        t_connected = time.monotonic()
        forget_splits(ctx.attn_metadata)
        names = [list(g.layer_names) for g in runner.kv_cache_config.kv_cache_groups]
        tokens = rebuild_kv(runner, names)
        forget_splits(ctx.attn_metadata)
    logger.warning("remote attention: recovered in %.2f s (%.2f s to reconnect, %.2f s to recompute %d tokens)",
                   time.monotonic() - t0, t_connected - t0, time.monotonic() - t_connected, tokens)
    runner.remote_recovery_log = [*getattr(runner, "remote_recovery_log", []), {
        "server": err.server, "nano_batched": ctx.ubatch_slices is not None, "tokens_rebuilt": tokens}]
    return tokens


def forward_with_recovery(runner, forward, *args, **kwargs):
    """`forward(*args, **kwargs)`, recovering from server loss (module doc). Nested calls (the
    stock runner's own wrapper under a nano-batch runner's) pass straight through, so recovery
    always happens at the outermost level, outside any executor."""
    if runner.__dict__.get("_recovery_active"):
        return forward(*args, **kwargs)
    runner._recovery_active = True
    try:
        err: AttentionServerLost | None = None
        for _ in range(MAX_ATTEMPTS):
            try:
                if err is not None:
                    recover(runner, err)
                return forward(*args, **kwargs)
            except AttentionServerLost as lost:
                err = lost
        raise err
    finally:
        runner._recovery_active = False


def _client_of(runner) -> DisaggAttentionClient:
    """The client this runner's model was built with (two in-process engines have two)."""

    layers = runner.vllm_config.compilation_config.static_forward_context.values()
    for layer in layers:
        client = getattr(getattr(layer, "impl", None), "_client", None)
        if client is not None:
            return client
    return backend.get_client()
