# SPDX-License-Identifier: Apache-2.0
"""Child-process peers for the transport test suite and `benchmarks/transport_bench.py`.

Each function runs in a `multiprocessing` spawn child and talks to the parent through a Pipe of
plain tuples (control only; all data goes through the transport under test). They exist so the
suite exercises real processes: fd passing, process death, cross-process wake-ups.
"""

from __future__ import annotations

import os
import time
import traceback
import zlib
from typing import Any

import numpy as np


def layer_data(seed: int, layer: int, num_blocks: int, block_elems: int) -> Any:
    """Deterministic `[num_blocks, block_elems]` float32 source data both sides can regenerate."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.randn(num_blocks, block_elems, generator=gen)


def crc32_of(tensors: list) -> int:
    """CRC-32 over the tensors' bytes, in order (the benchmark's proof that bytes landed)."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.contiguous().numpy().view(np.uint8), crc)
    return crc


def _transport(kind: str, token: str, **over: Any):
    from vllm_disagg.transport import TransportOptions, get_transport

    return get_transport(kind, TransportOptions(auth_token=token, **over))


def kv_sender_child(kind: str, token: str, conn, options: dict | None = None) -> None:
    """Commands: ("connect", addr) -> ("ok", regions); ("write", seed, plan) -> ("done", states);
    ("stream", seed, plan) writes forever (until killed); ("exit",)."""
    try:
        tx = _transport(kind, token, **(options or {})).kv_sender(name=f"child-{os.getpid()}")
        peer = None
        while True:
            cmd = conn.recv()
            if cmd[0] == "connect":
                peer = tx.connect(cmd[1], timeout=20)
                conn.send(("ok", sorted(peer.regions)))
            elif cmd[0] in ("write", "stream"):
                conn.send(("done", _run_writes(peer, cmd[1], cmd[2], forever=cmd[0] == "stream")))
            elif cmd[0] == "exit":
                tx.close()
                conn.send(("bye",))
                return
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _run_writes(peer, seed: int, plan: list[tuple], forever: bool = False) -> list[str]:
    """`plan`: (region, layer, num_src_blocks, block_elems, src_ids, dst_ids, transfer_id) per write."""
    from vllm_disagg.transport import BlockWrite

    sources = {}
    while True:
        handles = []
        for region, layer, nsrc, elems, src_ids, dst_ids, transfer_id in plan:
            key = (layer, nsrc, elems)
            if key not in sources:
                sources[key] = layer_data(seed, layer, nsrc, elems)
            handles.append(
                peer.write_blocks([BlockWrite(region, sources[key], src_ids, dst_ids)], transfer_id, layer)
            )
        states = []
        for h in handles:
            try:
                h.wait(60)
                states.append("done")
            except Exception as err:  # report the error class to the parent
                states.append(type(err).__name__)
        if not forever:
            return states


def kv_receiver_child(
    kind: str, token: str, conn, num_layers: int, num_blocks: int, block_elems: int, report_every: int = 1
) -> None:
    """Registers regions `layer.{i}`, sends ("addr", address), then consumes notifications until
    told to exit, reporting every `report_every`-th one (by seq) to the parent with the time it
    was seen; ("crc",) answers ("crc", CRC-32 of all regions)."""
    import torch

    from vllm_disagg.errors import TransportTimeout

    try:
        rx = _transport(kind, token).kv_receiver(name="child-rx")
        caches = [torch.zeros(num_blocks, block_elems) for _ in range(num_layers)]
        for i, t in enumerate(caches):
            rx.register_region(f"layer.{i}", t)
        conn.send(("addr", rx.start()))
        while True:
            if conn.poll(0):
                cmd = conn.recv()[0]
                if cmd == "exit":
                    break
                if cmd == "crc":
                    conn.send(("crc", crc32_of(caches)))
            try:
                n = rx.wait_notification(timeout=0.05)
            except TransportTimeout:
                continue
            if (n.seq + 1) % report_every == 0:
                conn.send(("notif", n.transfer_id, n.layer, n.seq, time.perf_counter()))
        rx.close()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def msg_echo_child(kind: str, token: str, conn, options: dict | None = None, out_nbytes: int = 0) -> None:
    """Serves one message channel that echoes every message back until the peer leaves.
    With `out_nbytes`, one-payload messages land in a preallocated buffer (like a real server)."""
    try:
        listener = _transport(kind, token, **(options or {})).listen_msg()
        conn.send(("addr", listener.address))
        ch = listener.accept(timeout=60)
        out = [memoryview(bytearray(out_nbytes))] if out_nbytes else None
        while True:
            m = ch.recv(out=out, timeout=120)
            ch.send(m.header, m.buffers)
    except Exception as err:
        try:
            conn.send(("end", type(err).__name__))
        except OSError:
            pass


def wait_for(conn, tag: str, timeout: float = 60.0) -> tuple:
    """Next message with `tag` from a child (raises with the child's traceback on error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            msg = conn.recv()
            if msg[0] == "error":
                raise RuntimeError(f"child failed:\n{msg[1]}")
            if msg[0] == tag:
                return msg
    raise TimeoutError(f"no {tag!r} from child within {timeout}s")
