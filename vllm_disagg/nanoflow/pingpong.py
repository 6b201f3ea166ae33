# SPDX-License-Identifier: Apache-2.0
"""Nano-batches of any model architecture, overlapped at network-bound attention (turn taking).

The op graph (`pipeline.py`) needs the exact Llama layer classes. Every other family (Qwen, Gemma,
Phi-3, GPT-OSS, MoE models ...) runs each nano-batch's whole forward on its own thread, and the
threads take turns in a fixed rotation: one computes at a time; one that blocks on network-bound
attention (`overlap.wait_network`) passes the turn to the next, whose dense layers (MoE experts
included) run while the attention servers work. Why a fixed rotation, send-ordered waits and one
forward context per thread: README.md, "pingpong.py".
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from vllm_disagg.nanoflow.units import set_num_threads
from vllm_disagg.overlap import set_turn

JOIN_TIMEOUT_S = 600.0  # every wait inside has its own (shorter) timeout; this only bounds a bug


class _SendOrder:
    """Tickets in send order; a wait runs only after every earlier-sent request's wait."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0
        self._serving = 0

    def take(self) -> int:
        with self._cond:
            self._next += 1
            return self._next - 1

    def run(self, ticket: int, fn):
        with self._cond:
            self._cond.wait_for(lambda: self._serving == ticket)
        try:
            return fn()
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


class _Rotation:
    """The turn passes 0, 1, ..., n-1, 0, ... among the nano-batches still running."""

    def __init__(self, num: int) -> None:
        self._cond = threading.Condition()
        self._active = list(range(num))
        self._turn = 0

    def acquire(self, index: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == index)

    def release(self, index: int, finished: bool = False) -> None:
        with self._cond:
            pos = self._active.index(index)
            if finished:
                self._active.remove(index)
            if self._active:
                self._turn = self._active[pos % len(self._active)] if finished else \
                    self._active[(pos + 1) % len(self._active)]
            self._cond.notify_all()


class _Turn:
    """One nano-batch thread's place in the rotation."""

    def __init__(self, index: int, rotation: _Rotation, order: _SendOrder, ctx: Any) -> None:
        self.index = index
        self.rotation = rotation
        self.order = order
        self.ctx = ctx
        self._entered = None

    def wait(self, fn):
        """`fn()` (a blocking network wait) without the turn, in send order; the request was sent
        just now, under the turn, so taking the ticket here keeps send order."""
        ticket = self.order.take()
        self.pause()
        try:
            return self.order.run(ticket, fn)
        finally:
            self.resume()

    def resume(self) -> None:
        from vllm.forward_context import override_forward_context

        self.rotation.acquire(self.index)
        self._entered = override_forward_context(self.ctx)
        self._entered.__enter__()

    def pause(self, finished: bool = False) -> None:
        if self._entered is not None:
            entered, self._entered = self._entered, None
            entered.__exit__(None, None, None)
        self.rotation.release(self.index, finished)


def pingpong_forward(model: Any, contexts: list[Any], fine: list[slice], input_ids, positions, inputs_embeds):
    """`sequential_forward`'s result, with nano-batch i's network waits overlapping the others' compute."""
    rotation, order = _Rotation(len(fine)), _SendOrder()
    outs: list[Any] = [None] * len(fine)
    errors: list[BaseException] = []
    # OpenMP's width is per OS thread: keep the worker's (a kernel split over more threads rounds
    # differently), with torch's own setter (CPUWorker stubs torch.set_num_threads)
    width = torch.get_num_threads()
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()  # thread-local too

    def body(i: int, rows: slice) -> None:
        set_num_threads(width)
        turn = _Turn(i, rotation, order, contexts[i])
        set_turn(turn)
        turn.resume()
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                outs[i] = model(
                    input_ids=None if input_ids is None else input_ids[rows],
                    positions=positions[..., rows],
                    intermediate_tensors=None,
                    inputs_embeds=None if inputs_embeds is None else inputs_embeds[rows],
                )
        except BaseException as err:  # noqa: BLE001 (re-raised on the caller's thread)
            errors.append(err)
        finally:
            set_turn(None)
            turn.pause(finished=True)

    threads = [threading.Thread(target=body, args=(i, rows), name=f"nanoflow-turn-{i}", daemon=True)
               for i, rows in enumerate(fine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
        if t.is_alive():
            raise TimeoutError(f"nanoflow: nano-batch thread {t.name} still running after {JOIN_TIMEOUT_S}s")
    if errors:
        raise errors[0]
    return torch.cat(outs, dim=0)
