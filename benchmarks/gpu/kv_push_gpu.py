# SPDX-License-Identifier: Apache-2.0
"""Step d: layer-wise KV push from GPU memory between two processes on one GPU.

The parent process is the decode side: it owns the destination KV (LLaMA-8B layer shape, bf16,
16-token blocks, scattered block ids). A spawned child is the prefill side: per layer, a "forward"
stream computes for a while and then writes the layer's KV; `kv.layer_events` records the layer's
event on that stream; a sender thread waits on it and pushes the layer's blocks. The parent checks
every landed byte (no layer may be read before its event: `stale_layers` must be 0).
* copy_limit: device-to-device copy in one process (a plain copy, and the block gather/scatter
  the push does), the ceiling for the two below.
* cuda_ipc_push: the child writes straight into the parent's KV through CUDA IPC (torch's CUDA
  tensor sharing), on a copy stream with per-layer CUDA events around each layer's copy.
* nixl_push: the project's NIXL transport (`transport/nixl`, VRAM regions, UCX's cuda transports)
  between the two processes, if the carried nixl wheel loads.
The CPU twin runs the same processes with CPU tensors (shared memory; nixl on DRAM when installed).
"""

from __future__ import annotations

import queue as queue_mod
import threading
import time
from dataclasses import dataclass
from typing import Any

from common import Budget, StepResult, Unsupported, cuda_ready, time_cuda

TOKEN = "gpu-kit-token"
CHECKS = ("copy_limit", "cuda_ipc_push", "nixl_push")


@dataclass(frozen=True)
class PushShape:
    num_layers: int = 32
    num_blocks: int = 512  # per layer: 8192 tokens of context
    block_shape: tuple[int, ...] = (2, 16, 8, 128)  # K/V, tokens, KV heads, head dim: 64 KiB in bf16
    compute_matmuls: int = 4  # the "forward" per layer: 4 x (4096 x 4096 x 4096) bf16


TWIN = PushShape(num_layers=3, num_blocks=8, block_shape=(2, 4, 2, 8), compute_matmuls=1)


def run_step(device: str, budget: Budget) -> StepResult:
    result = StepResult("d", "layer-wise KV push from GPU memory between two processes", device)
    why_not = cuda_ready() if device == "cuda" else None
    if why_not:
        for name in CHECKS:
            result.skip(name, why_not)
        return result
    shape = PushShape() if device == "cuda" else TWIN
    if device == "cuda":
        result.run("copy_limit", lambda: copy_limit(shape), budget, 30)
    else:
        result.skip("copy_limit", "CPU twin: no GPU")
    result.run("cuda_ipc_push", lambda: push(device, shape, "ipc"), budget, 90)
    result.run("nixl_push", lambda: push(device, shape, "nixl"), budget, 120)
    return result


def _dtype(device: str):
    import torch

    return torch.bfloat16 if device == "cuda" else torch.float32


def block_ids(shape: PushShape, seed: int) -> list[int]:
    import torch

    return torch.randperm(shape.num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()


def layer_pattern(layer: int, shape: PushShape, device: str):
    """What the prefill side's forward writes into layer `layer` (reproducible on both sides)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(1000 + layer)
    return torch.randn(shape.num_blocks, *shape.block_shape, generator=gen, device=device, dtype=_dtype(device))


def copy_limit(shape: PushShape) -> dict:
    import torch

    nbytes = shape.num_blocks * _numel(shape.block_shape) * 2 * shape.num_layers
    plain = _plain_copy_ms(nbytes)
    layer_src = layer_pattern(0, shape, "cuda")
    layer_dst = torch.empty_like(layer_src)
    src_ids = torch.tensor(block_ids(shape, 1), device="cuda")
    dst_ids = torch.tensor(block_ids(shape, 2), device="cuda")

    def gather_scatter() -> None:
        layer_dst[dst_ids] = layer_src[src_ids]

    scattered = time_cuda(gather_scatter, iters=50)["median_ms"] * shape.num_layers
    return {"bytes": nbytes, "plain_copy_gbs": round(nbytes / plain / 1e6, 1),
            "plain_copy_read_plus_write_gbs": round(2 * nbytes / plain / 1e6, 1),
            "block_gather_scatter_gbs": round(nbytes / scattered / 1e6, 1),
            "definition": "payload bytes / time (CUDA events, median); read_plus_write counts both directions"}


def _plain_copy_ms(nbytes: int) -> float:
    import torch

    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return time_cuda(lambda: dst.copy_(src), iters=20)["median_ms"]


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def push(device: str, shape: PushShape, kind: str) -> dict:
    """Run one two-process push; the parent (decode side) verifies every landed byte."""
    import torch
    import torch.multiprocessing as mp

    if kind == "nixl":
        _require_nixl()
    dtype = _dtype(device)
    dst = [torch.zeros(shape.num_blocks, *shape.block_shape, device=device, dtype=dtype)
           for _ in range(shape.num_layers)]
    receiver, address = _open_receiver(kind, dst) if kind == "nixl" else (None, None)
    ctx = mp.get_context("spawn")
    answers, release = ctx.Queue(), ctx.Event()
    args = (device, shape, kind, dst if kind == "ipc" else None, address, answers, release)
    child = ctx.Process(target=prefill_side, args=args, daemon=True)
    t0 = time.perf_counter()
    try:
        child.start()
        report = _collect(answers, receiver, shape, timeout_s=300 if device == "cuda" else 60)
    except RuntimeError as err:
        if kind == "ipc" and "ipc" in str(err).lower():
            raise Unsupported(f"CUDA IPC: {err}") from None
        raise
    finally:
        release.set()  # the sender closes only now: nixl's receiver drops notifications that trail a BYE
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        if receiver is not None:
            receiver.close()
    wall_s = time.perf_counter() - t0
    stale = _verify(dst, shape, device)
    if stale:
        raise RuntimeError(f"layers {stale} landed with other bytes than the prefill side wrote")
    nbytes = shape.num_layers * shape.num_blocks * _numel(shape.block_shape) * dst[0].element_size()
    push_s = report["last_landed_s"] - report["first_issue_s"]
    return {"kind": kind, "bytes": nbytes, "layers": shape.num_layers, "stale_layers": stale,
            "push_gbs": round(nbytes / push_s / 1e9, 2) if push_s > 0 else None,
            "first_issue_to_last_landed_ms": round(push_s * 1e3, 2),
            "exposed_after_forward_ms": round((report["last_landed_s"] - report["forward_done_s"]) * 1e3, 2),
            "per_layer_copy_ms": report.get("copy_ms"), "per_layer_wait_ms": report.get("event_wait_ms"),
            "copy_span_gbs": (round(nbytes / report["copy_span_ms"] / 1e6, 2) if report.get("copy_span_ms") else None),
            "forward_ms": round((report["forward_done_s"] - report["start_s"]) * 1e3, 2),
            "wall_s": round(wall_s, 2), "device": device,
            "definition": "push_gbs: payload bytes / (first layer write issued -> last layer landed, host clock); "
                          "copy_span_gbs (ipc): payload bytes / (first copy's start event -> last copy's end "
                          "event); per_layer_copy_ms: CUDA events around each layer's copy (ipc)"}


def _require_nixl() -> None:
    try:
        import nixl  # noqa: F401
    except ImportError as err:
        raise Unsupported(f"nixl not importable ({err}); carry it with `make gpu-wheels`") from None


def _open_receiver(kind: str, dst: list) -> tuple[Any, str]:
    from vllm_disagg.transport import TransportOptions, get_transport

    transport = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=60.0))
    receiver = transport.kv_receiver(name="decode")
    for layer, tensor in enumerate(dst):
        receiver.register_region(str(layer), tensor)
    return receiver, receiver.start()


def _collect(answers, receiver, shape: PushShape, timeout_s: float) -> dict:
    """The child's timeline; with a transport, also wait for every layer's notification here."""
    deadline = time.monotonic() + timeout_s
    landed: dict[int, float] = {}
    report = None
    while report is None or (receiver is not None and len(landed) < shape.num_layers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"push incomplete after {timeout_s}s: {len(landed)} layers notified")
        if receiver is not None:
            for note in receiver.poll_notifications():
                landed[note.layer] = time.perf_counter()
        try:
            msg = answers.get(timeout=0.001 if receiver is not None else 1.0)
        except queue_mod.Empty:
            continue
        if isinstance(msg, str):
            raise RuntimeError(f"prefill side: {msg}")
        report = msg
    if receiver is not None:
        report["last_landed_s"] = max(landed.values())
    return report


def _verify(dst: list, shape: PushShape, device: str) -> list[int]:
    import torch

    src_ids, dst_ids = block_ids(shape, 1), block_ids(shape, 2)
    stale = []
    for layer, tensor in enumerate(dst):
        want = layer_pattern(layer, shape, device)[src_ids]
        if not torch.equal(tensor[dst_ids], want):
            stale.append(layer)
    return stale


# ------------------------------------------------------------------ the prefill side (child process)
def prefill_side(device: str, shape: PushShape, kind: str, dst, address, answers, release) -> None:
    send = None
    try:
        timeline, send = _prefill(device, shape, kind, dst, address)
        answers.put(timeline)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        answers.put(f"{type(err).__name__}: {err}")
    release.wait(600)  # close (and exit) only once the decode side has every notification
    if send is not None:
        send.close()


def _prefill(device: str, shape: PushShape, kind: str, dst, address) -> tuple[dict, Any]:
    import torch

    from vllm_disagg.kv.layer_events import StreamTwin, device_events

    dtype = _dtype(device)
    patterns = [layer_pattern(layer, shape, device) for layer in range(shape.num_layers)]
    src = [torch.zeros_like(p) for p in patterns]  # stale until the layer's "forward" writes it
    work = torch.randn(4096 if device == "cuda" else 64, 4096 if device == "cuda" else 64, device=device, dtype=dtype)
    send = _ipc_sender(dst, shape, device) if kind == "ipc" else _transport_sender(kind, address, shape)
    events, twin = (device_events(torch.device(device)), None) if device == "cuda" else (None, StreamTwin())
    jobs: queue_mod.Queue = queue_mod.Queue()
    timeline: dict[str, Any] = {"event_wait_ms": [], "copy_ms": []}
    sender = threading.Thread(target=_send_layers, args=(jobs, send, src, timeline), daemon=True)
    sender.start()
    stream = torch.cuda.Stream() if device == "cuda" else None
    timeline["start_s"] = time.perf_counter()
    for layer in range(shape.num_layers):
        if stream is not None:
            with torch.cuda.stream(stream):
                _forward_layer(work, shape, src[layer], patterns[layer])
                jobs.put((layer, events.record()))
        else:
            twin.submit(lambda w=work, s=src[layer], p=patterns[layer]: _forward_layer(w, shape, s, p))
            jobs.put((layer, twin.record()))
    if stream is not None:
        stream.synchronize()
    else:
        twin.synchronize()
    timeline["forward_done_s"] = time.perf_counter()
    jobs.put(None)
    sender.join(timeout=300)
    if "error" in timeline:
        raise RuntimeError(timeline["error"])
    send.finish(timeline)
    return timeline, send


def _forward_layer(work, shape: PushShape, src_layer, pattern) -> None:
    for _ in range(shape.compute_matmuls):
        work = work @ work
        work = work / work.norm()
    src_layer.copy_(pattern)


def _send_layers(jobs: queue_mod.Queue, send, src: list, timeline: dict) -> None:
    try:
        while (job := jobs.get()) is not None:
            layer, event = job
            t0 = time.perf_counter()
            if not event.wait(120.0):
                raise TimeoutError(f"layer {layer}'s event never completed")
            timeline["event_wait_ms"].append(round((time.perf_counter() - t0) * 1e3, 3))
            timeline.setdefault("first_issue_s", time.perf_counter())
            send(layer, src[layer])
    except BaseException as err:  # noqa: BLE001 - surfaced by _prefill
        timeline["error"] = f"{type(err).__name__}: {err}"


class _ipc_sender:  # noqa: N801 - used as a function
    """Copies a layer's blocks into the decode side's KV (opened through CUDA IPC) on a copy stream."""

    def __init__(self, dst: list, shape: PushShape, device: str):
        import torch

        self.dst, self.device = dst, device
        self.src_ids = torch.tensor(block_ids(shape, 1), device=device)
        self.dst_ids = torch.tensor(block_ids(shape, 2), device=device)
        self.stream = torch.cuda.Stream() if device == "cuda" else None
        self.marks: list = []

    def __call__(self, layer: int, src_layer) -> None:
        import torch

        if self.stream is None:
            self.dst[layer][self.dst_ids] = src_layer[self.src_ids]
            self.marks.append(time.perf_counter())
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            self.dst[layer][self.dst_ids] = src_layer[self.src_ids]
            end.record(self.stream)
        self.marks.append((start, end))

    def finish(self, timeline: dict) -> None:
        if self.stream is None:
            timeline["last_landed_s"] = self.marks[-1]
            return

        self.stream.synchronize()
        timeline["last_landed_s"] = time.perf_counter()  # upper bound: after the last copy's sync
        timeline["copy_ms"] = [round(s.elapsed_time(e), 3) for s, e in self.marks]
        timeline["copy_span_ms"] = round(self.marks[0][0].elapsed_time(self.marks[-1][1]), 3)

    def close(self) -> None:
        pass


class _transport_sender:  # noqa: N801 - used as a function
    """`KVPeer.write_blocks` of the project's transport, one call per layer."""

    def __init__(self, kind: str, address: str, shape: PushShape):
        from vllm_disagg.transport import TransportOptions, get_transport

        self.transport = get_transport(kind, TransportOptions(auth_token=TOKEN, timeout_s=60.0))
        self.sender = self.transport.kv_sender(name="prefill")
        self.peer = self.sender.connect(address, timeout=60.0)
        self.src_ids, self.dst_ids = block_ids(shape, 1), block_ids(shape, 2)
        self.handles: list = []

    def __call__(self, layer: int, src_layer) -> None:
        from vllm_disagg.transport import BlockWrite

        write = BlockWrite(str(layer), src_layer, self.src_ids, self.dst_ids)
        self.handles.append(self.peer.write_blocks([write], "gpu-kit", layer))

    def finish(self, timeline: dict) -> None:
        for handle in self.handles:
            handle.wait(120.0)

    def close(self) -> None:
        self.sender.close()
