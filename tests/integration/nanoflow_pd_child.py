# SPDX-License-Identifier: Apache-2.0
"""`pd_engine_child.py` with nano-batching: the same engine child, plus one option.

    python nanoflow_pd_child.py ROLE MODEL_DIR JSON_OPTIONS

JSON_OPTIONS as pd_engine_child.py, plus `nano_batches` (int): run the engine on the NanoFlow
worker with that many nano-batches. Each generate answer then also carries `nano_stats`
(`collective_rpc("nanoflow_stats")`), so the test can check that steps really were nano-batched.
`late_nano_delay_s` (float): sleep that long before every attention op of nano-batches after the
first, so a KV push that does not wait for the last nano-batch of a layer would read stale KV.

On a prefill engine, every KV write the sender issues is checked for stale data: the digest of its
source blocks when it was issued must equal their digest once the request's prefill is over (the
blocks stay allocated until the push is released). The answer carries `kv_writes_checked` and
`kv_writes_stale`. (Tokens alone do not show stale KV with a dummy-weight model: its attention is
nearly uniform over tiny values, so its greedy tokens hardly depend on the context.)
"""

from __future__ import annotations

import json
import sys

import pd_engine_child as base

NANO_WORKER = "vllm_disagg.nanoflow.worker.NanoFlowCPUWorker"


def _with_nanoflow(tiny_llm_kwargs, nano_batches: int):
    def kwargs(model_dir, **over):
        extra = dict(over.get("additional_config") or {})
        disagg = dict(extra.get("disagg") or {})
        disagg["nanoflow"] = {"nano_batches": nano_batches}
        extra["disagg"] = disagg
        return tiny_llm_kwargs(model_dir, **{**over, "additional_config": extra, "worker_cls": NANO_WORKER})

    return kwargs


def _with_stats(generate):
    def run(llm, cmd: dict) -> dict:
        out = generate(llm, cmd)
        out["nano_stats"] = llm.collective_rpc("nanoflow_stats")[0]
        return out

    return run


def _delay_late_nano_batches(delay_s: float) -> None:
    import time

    from vllm_disagg.nanoflow import pipeline

    original = pipeline.LlamaPipeline._attn

    def slow_attn(self, st, li: int, a: int) -> None:
        if a > 0:
            time.sleep(delay_s)
        original(self, st, li, a)

    pipeline.LlamaPipeline._attn = slow_attn


class _StaleWriteCheck:
    """Digests of each issued write's source blocks, re-checked when the request's prefill is over."""

    def __init__(self) -> None:
        self.pending: dict[str, list[tuple[object, list[int], str]]] = {}
        self.checked = 0
        self.stale = 0

    @staticmethod
    def digest(src, block_ids: list[int]) -> str:
        import hashlib

        return hashlib.sha256(src[block_ids].contiguous().numpy().tobytes()).hexdigest()

    def install(self) -> None:
        from vllm_disagg.kv import push_sender

        issue, step_done = push_sender.PushSender._issue, push_sender.PushSender.step_done
        check = self

        def checked_issue(sender, push, writes, layer):
            for w in writes:
                ids = list(w.src_block_ids)
                check.pending.setdefault(push.req_id, []).append((w.src, ids, check.digest(w.src, ids)))
            issue(sender, push, writes, layer)

        def checked_step_done(sender, *args):
            step_done(sender, *args)
            for req_id, push in list(sender._pushes.items()):
                if push.t_prefill_done is not None:
                    check.verify(req_id)

        push_sender.PushSender._issue = checked_issue
        push_sender.PushSender.step_done = checked_step_done

    def verify(self, req_id: str) -> None:
        for src, ids, then in self.pending.pop(req_id, []):
            self.checked += 1
            self.stale += then != self.digest(src, ids)


def _with_write_check(generate, check: _StaleWriteCheck):
    def run(llm, cmd: dict) -> dict:
        out = generate(llm, cmd)
        for req_id in list(check.pending):  # writes issued after their prefill ended
            check.verify(req_id)
        out["kv_writes_checked"], out["kv_writes_stale"] = check.checked, check.stale
        return out

    return run


def main() -> None:
    opts = json.loads(sys.argv[3])
    nano = opts.get("nano_batches")
    if opts.get("late_nano_delay_s"):
        _delay_late_nano_batches(float(opts["late_nano_delay_s"]))
    if nano:
        import vllm_disagg.testing as testing

        testing.tiny_llm_kwargs = _with_nanoflow(testing.tiny_llm_kwargs, int(nano))
        base._generate = _with_stats(base._generate)
    if sys.argv[1] == "prefill":
        check = _StaleWriteCheck()
        check.install()
        base._generate = _with_write_check(base._generate, check)
    base.main()


if __name__ == "__main__":
    main()
