# SPDX-License-Identifier: Apache-2.0
"""One real vLLM engine (tiny model, in-process EngineCore) driven over stdin/stdout JSON lines.

Used by test_pd_connector.py to run prefill, decode and plain engines in separate processes:

    python pd_engine_child.py ROLE MODEL_DIR JSON_OPTIONS
    -> {"ready": true, "free_blocks": N, "kv_address": ..., "kv_cache_groups": G, "handshake": {...}}
    <- {"cmd": "generate", "prompts": [[ids]], "params": [kv_transfer_params|null], "max_tokens": n}
    -> {"outputs": [[ids]], "finish_reasons": [...], "free_blocks": N, "timeline": [...], "elapsed_s": t}
    <- {"cmd": "exit"}

ROLE is prefill, decode or plain. JSON_OPTIONS: kv_port, threshold, transport, policy, dtype, token, advertise
(decode: the KV receiver address given to the prefill side, e.g. a throttling proxy's), verify (decode:
`kv.verify_checksums`),
write_delay_s (prefill only: sleep before each KV write, to make "kill P mid-transfer" reliable),
tp (tensor-parallel size; > 1 reports each rank's connector as "ranks" through `testing.kv_probe`),
affinity (CPU ids for this engine's processes: workers inherit them before their OpenMP binding),
mnbt (max_num_batched_tokens: P's prefill chunk), prefix_caching (vLLM's, off by default).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _build_llm(role: str, model_dir: str, opts: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from vllm_disagg.testing import tiny_llm_kwargs

    over: dict = {"dtype": opts.get("dtype", "float32"), "max_num_batched_tokens": opts.get("mnbt", 2048),
                  "enable_prefix_caching": bool(opts.get("prefix_caching", False))}
    if opts.get("tp", 1) > 1:
        from vllm_disagg.testing.kv_probe import KV_PROBE

        over.update(tensor_parallel_size=opts["tp"], worker_extension_cls=KV_PROBE)
    if role != "plain":
        over["kv_transfer_config"] = KVTransferConfig(
            kv_connector="DisaggConnector",
            kv_connector_module_path="vllm_disagg.kv.connector",
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_load_failure_policy=opts.get("policy", "recompute"),
        )
        over["additional_config"] = {
            "disagg": {
                "role": role,
                "auth_token": opts.get("token", "test-token"),
                "kv": {
                    "kv_port": opts["kv_port"],
                    "layerwise_threshold_tokens": opts.get("threshold", 256),
                    "push_timeout_s": opts.get("push_timeout_s", 30.0),
                    "transport": opts.get("transport", "tcp"),
                    "advertise_address": opts.get("advertise"),
                    "verify_checksums": opts.get("verify", False),
                },
            }
        }
    return LLM(**tiny_llm_kwargs(model_dir, **over))


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group().connector_worker if has_kv_transfer_group() else None


def _slow_writes(delay_s: float) -> None:
    """Fault injection for the kill test: delay every KV write issued by the prefill sender."""
    from vllm_disagg.kv import push_sender

    original = push_sender.PushSender._issue

    def slow_issue(self, push, writes, layer):
        time.sleep(delay_s)
        original(self, push, writes, layer)

    push_sender.PushSender._issue = slow_issue


def _generate(llm, cmd: dict) -> dict:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True,
                       extra_args={"kv_transfer_params": kv} if kv else None)
        for kv in cmd["params"]
    ]
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - t0
    sched = _scheduler(llm)
    deadline = time.monotonic() + 60
    while sched.has_requests() and time.monotonic() < deadline:  # let pushes finish and blocks free
        llm.llm_engine.step()
        time.sleep(0.005)
    ranks = _probe_ranks(llm)
    worker = _worker_connector()
    timeline = list(getattr(getattr(worker, "sender", None), "timeline", [])) if ranks is None else []
    return {
        "ranks": ranks,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "kv_params": [o.kv_transfer_params for o in outs],
        "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "timeline": timeline,
        "elapsed_s": elapsed,
    }


def _probe_ranks(llm) -> list[dict] | None:
    """Each TP rank's connector (worker processes), or None for an in-process single worker."""
    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 1:
        return None
    return llm.collective_rpc("disagg_kv_probe")


def main() -> None:
    role, model_dir, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 pid` dumps every thread's stack to the log
    from vllm_disagg.testing import apply_test_env

    apply_test_env(in_process=True)
    if opts.get("affinity"):
        os.sched_setaffinity(0, opts["affinity"])
    if opts.get("write_delay_s"):
        _slow_writes(opts["write_delay_s"])
    llm = _build_llm(role, model_dir, opts)
    ranks = _probe_ranks(llm)
    worker = None if ranks is not None else _worker_connector()
    side = getattr(worker, "sender", None) or getattr(worker, "receiver", None)
    scheduler = _scheduler(llm)
    _emit({"ready": True, "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
           "kv_address": getattr(side, "address", None), "ranks": ranks,
           "kv_cache_groups": len(scheduler.kv_cache_config.kv_cache_groups),
           "handshake": dataclasses.asdict(side.handshake) if hasattr(side, "handshake") else None})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        _emit(_generate(llm, cmd))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
