# SPDX-License-Identifier: Apache-2.0
"""Remote attention (Lamina) on the nano-batch executor: at pipeline depth 2 the attention ops run on
the "net" unit while the other nano-batch's dense ops run; at depth 1 the same nano-batches run
serially (the benchmark's baseline). Greedy output equals plain vLLM token for token in both, also
when an attention server is SIGKILLed in the middle of the decode: the nano-batched step fails as a
whole, the KV is rebuilt by recompute and the step re-runs (attention/recovery.py)."""

from __future__ import annotations

import gc
import os

import pytest

from vllm_disagg.testing import tiny_llm_kwargs, token_prompts

pytestmark = pytest.mark.slow
os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "test-token")
PROMPTS = token_prompts(2, 120, seed=11) + token_prompts(6, 40, seed=12)


def _generate(model_dir: str, **extra):
    from vllm import LLM, SamplingParams

    llm = LLM(**tiny_llm_kwargs(model_dir, max_num_batched_tokens=128, **extra))
    try:
        sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        stats = llm.collective_rpc("nanoflow_stats")[0] if "worker_cls" in extra else None
        got = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        return got, stats
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return _generate(tiny_model_dir)[0]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, plain):
    from vllm_disagg.testing.attention import start_local_servers

    servers = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    try:
        runs = {}
        for depth in (None, 1):  # None: the worker's default (ping-pong)
            ra = {"servers": [s.http for s in servers]}
            if depth is not None:
                ra.update(pipeline=depth, spin_us=50.0)
            runs[depth] = _generate(
                tiny_model_dir,
                worker_cls="vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker",
                additional_config={"disagg": {"remote_attention": ra, "nanoflow": {"nano_batches": 2}}},
            )
    finally:
        for s in servers:
            s.stop()
    (nano, stats), serial = runs[None], runs[1]
    return plain, nano, stats, serial


def _assert_same(got, plain) -> None:
    for (toks, lps), (ref_toks, ref_lps) in zip(got, plain):
        assert toks == ref_toks
        for step, ref_step in zip(lps, ref_lps):
            for tok, lp in ref_step.items():
                assert step[tok].logprob == pytest.approx(lp.logprob, abs=1e-3)


def test_two_nano_batches_in_flight_on_remote_attention_match_plain_vllm(runs):
    plain, nano, _, _ = runs
    _assert_same(nano, plain)


def test_pipeline_depth_one_runs_the_same_nano_batches_serially_and_matches_plain_vllm(runs):
    plain, _, _, (serial, stats) = runs
    _assert_same(serial, plain)
    assert stats["pipeline_steps"] > 0 and stats["decode_steps"] > 0
    assert stats["inline"] is True  # nothing overlaps: one batch in flight
    assert {u["name"] for u in stats["units"]} == {"dense"}
    assert stats["split_attention_steps"] == 0


def test_remote_attention_ops_run_on_the_network_unit_thread(runs):
    _, _, stats, _ = runs
    assert stats["pipeline_steps"] > 0 and stats["fallback_steps"] == 0
    assert stats["inline"] is False
    assert {u["name"] for u in stats["units"]} == {"dense", "net"}
    assert stats["decode_steps"] > 0 and stats["mixed_steps"] > 0
    # each request is sent from the dense unit right after its KQV; the net unit only waits
    assert stats["split_attention_steps"] == stats["pipeline_steps"]


def _decode_killing_one_server(model_dir: str, remote: dict, depth: int, kill, **over):
    """Decode PROMPTS step by step; once every request has 2 tokens, `kill()` runs on a timer
    thread while the next step runs (the loss lands anywhere inside the pipelined step or just
    after it). Returns (tokens by request, nanoflow_stats, client)."""
    import threading

    from vllm import LLM, SamplingParams

    from vllm_disagg.attention import backend  # the worker runs in this process (in-process engine)

    ra = {**remote, "pipeline": depth, "timeout_s": 10.0}
    llm = LLM(**tiny_llm_kwargs(
        model_dir, max_num_batched_tokens=128, **over,
        worker_cls="vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker",
        additional_config={"disagg": {"remote_attention": ra, "nanoflow": {"nano_batches": 2}}}))
    try:
        engine = llm.llm_engine
        sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, sp)
        done, lens, killer = {}, {}, None
        while engine.has_unfinished_requests():
            if killer is None and len(lens) == len(PROMPTS) and min(lens.values()) >= 2:
                killer = threading.Timer(0.002, kill)
                killer.start()
            for out in engine.step():
                lens[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    done[int(out.request_id)] = list(out.outputs[0].token_ids)
        assert killer is not None, "the decode ended before the kill"
        killer.join()
        stats = llm.collective_rpc("nanoflow_stats")[0]
        return [done.get(i) for i in range(len(PROMPTS))], stats, backend.get_client()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.mark.parametrize(
    ("depth", "partition", "replace"),
    [(2, "head", False), (2, "request", False), (2, "head", True), (1, "request", False)],
    ids=["n2-head-survivor", "n2-request-survivor", "n2-head-replacement", "n1-request-survivor"],
)
def test_killing_an_attention_server_inside_a_nano_batched_step_loses_no_request(
    tiny_model_dir, plain, depth, partition, replace
):
    from vllm_disagg.testing.attention import start_local_server, start_local_servers

    own = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    replacement = []

    def kill() -> None:
        own[1].kill()
        if replace:  # same address: the recovery waits for it (replacement_wait_s) and re-shards over both
            port = int(own[1].http.rsplit(":", 1)[1])
            replacement.append(start_local_server(transport="shm", kv_cache_gib=0.0625, http_port=port))

    remote = {"servers": [s.http for s in own], "partition": partition}
    if replace:
        remote["replacement_wait_s"] = 120.0
    # headroom for head-wise on the survivor: it then holds every head, so half its blocks
    over = {} if replace or partition == "request" else {"num_gpu_blocks_override": 256}
    try:
        got, stats, client = _decode_killing_one_server(tiny_model_dir, remote, depth, kill, **over)
    finally:
        for s in own + replacement:
            s.stop()
    assert got == [toks for toks, _ in plain]  # every request finished, greedy tokens as plain vLLM
    assert client.num_recoveries == 1
    survivors = [own[0].http, own[1].http] if replace else [own[0].http]
    assert [c.http_addr for c in client.conns] == survivors
    (rec,) = stats["remote_recoveries"]
    assert rec["server"] == own[1].http and rec["nano_batched"] and rec["tokens_rebuilt"] > 0
    assert stats["inline"] is (depth == 1)
