# SPDX-License-Identifier: Apache-2.0
"""Retained-KV reuse, connector side: block keys, and the scheduler half driven by vLLM's real
`Scheduler` (with `DisaggConnector` loaded as configured for a Lamina model worker), step by step.

Each step: (a) schedule, (b) read the connector metadata the worker would get, (c) feed back a
model output (one sampled token per request whose prefill is done, plus the blocks whose restore
failed). The servers' retained keys come in through `RetainedIndex`'s fetch function."""

from __future__ import annotations

import copy
import hashlib
import os

import numpy as np
import pytest

from vllm_disagg.attention.block_keys import ROOT_KEY, chain_keys, model_salt
from vllm_disagg.kv.lamina.reuse import RetainedIndex

BS = 32
SALT = b"unit-salt"
CONNECTOR = {"kv_connector": "DisaggConnector", "kv_connector_module_path": "vllm_disagg.kv.connector",
             "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


# ---------------------------------------------------------------- keys
def test_block_keys_chain_blake2b_over_the_previous_key_the_salt_and_int32_token_ids():
    tokens = _prompt(100, 0)
    keys = chain_keys(tokens, BS, SALT)
    assert len(keys) == 3  # the partial fourth block has no key
    first = hashlib.blake2b(ROOT_KEY + SALT + np.asarray(tokens[:BS], "<i4").tobytes(), digest_size=16).digest()
    second = hashlib.blake2b(first + SALT + np.asarray(tokens[BS:2 * BS], "<i4").tobytes(), digest_size=16).digest()
    assert keys[:2] == [first, second]
    assert chain_keys(tokens[2 * BS:], BS, SALT, keys[1]) == keys[2:]  # a chain extends block by block


def test_a_block_key_names_the_whole_prefix_and_the_salt():
    a, b = _prompt(96, 1), _prompt(96, 1)
    b[5] += 1  # one token of block 0 differs: every later key differs too
    ka, kb = chain_keys(a, BS, SALT), chain_keys(b, BS, SALT)
    assert all(x != y for x, y in zip(ka, kb))
    assert chain_keys(a, BS, b"other") != ka
    assert chain_keys(a[:64], BS, SALT) == ka[:2]


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_disagg.testing import make_tiny_llama, tiny_llm_kwargs

    os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "unit-token")
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-reuse"))
    remote = {"servers": ["127.0.0.1:9", "127.0.0.1:10"], "partition": "head"}  # nothing listens there
    kwargs = tiny_llm_kwargs(model, kv_transfer_config=CONNECTOR, additional_config={"disagg": {"remote_attention": remote}})
    kwargs.pop("seed", None)
    return EngineArgs(**kwargs).create_engine_config()


def test_the_salt_changes_with_what_changes_the_kv(vllm_config):
    other = copy.deepcopy(vllm_config)
    assert model_salt(other) == model_salt(vllm_config)
    other.cache_config.block_size = 16
    assert model_salt(other) != model_salt(vllm_config)


# ---------------------------------------------------------------- the scheduler half in vLLM's scheduler
class Engine:
    """vLLM's Scheduler with the DisaggConnector; the test plays the model runner."""

    def __init__(self, vllm_config, retained: list[set[bytes]], num_blocks: int = 64, policy: str = "recompute"):
        import torch
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        cfg = copy.deepcopy(vllm_config)
        cfg.cache_config.num_gpu_blocks = num_blocks
        cfg.kv_transfer_config.kv_load_failure_policy = policy
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        self.sched = Scheduler(vllm_config=cfg, kv_cache_config=kv, block_size=BS,
                               structured_output_manager=StructuredOutputManager(cfg))
        self.reuse = self.sched.connector.connector_scheduler.reuse
        self.salt = self.reuse.salt
        answers = dict(zip(self.reuse.index.servers, retained, strict=True))
        self.reuse.index = RetainedIndex(self.reuse.index.servers, "t", BS, fetch=lambda s, _: {
            "block_size": BS, "keys": answers[s], "ttl_s": 600.0})
        self.reuse.index.refresh()

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 20):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        sp.update_from_generation_config({}, None)
        self.sched.add_request(Request(req_id, prompt, sp, None))
        return self.sched.requests[req_id]

    def step(self, failed_blocks: frozenset[int] = frozenset()):
        """One engine step; returns (scheduler output, its ReuseMeta)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        meta = out.kv_connector_metadata.reuse
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if self.sched.requests[r].num_computed_tokens >= self.sched.requests[r].num_tokens else []
                   for r in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(invalid_block_ids=set(failed_blocks)))
        self.sched.update_from_output(out, mro)
        return out, meta

    def blocks(self, req_id: str) -> list[int]:
        return self.sched.kv_cache_manager.get_block_ids(req_id)[0]


def test_without_retained_kv_full_blocks_are_registered_one_step_after_their_kv_was_written(vllm_config):
    eng = Engine(vllm_config, [set(), set()])
    prompt = _prompt(100, 2)
    eng.add("a", prompt, max_tokens=64)
    out, meta = eng.step()  # STEP (1) prefill of 100 tokens: nothing is on the servers yet
    assert out.num_scheduled_tokens == {"a": 100} and not out.has_sync_kv_loads
    assert meta.restores == [] and meta.reg_block_ids == []
    _, meta = eng.step()  # STEP (2) first decode: the prompt's 3 full blocks were written by step 1
    blocks = eng.blocks("a")
    assert meta.reg_block_ids == blocks[:3] and meta.reg_keys == chain_keys(prompt, BS, eng.salt)
    assert meta.reg_owners == [blocks[0]] * 3
    for _ in range(27):  # STEPS (3..29): tokens 101..127; block 3 fills with token 127's KV
        _, meta = eng.step()
        assert meta.reg_block_ids == []
    req = eng.sched.requests["a"]
    assert req.num_computed_tokens == 128
    _, meta = eng.step()
    assert meta.reg_block_ids == [eng.blocks("a")[3]]
    assert meta.reg_keys == chain_keys(list(req.all_token_ids[:128]), BS, eng.salt)[3:]


def test_retained_leading_blocks_are_restored_and_only_the_tail_is_computed(vllm_config):
    prompt = _prompt(100, 3)
    eng = Engine(vllm_config, [set(), set()])
    keys = chain_keys(prompt, BS, eng.salt)
    eng.reuse.index = RetainedIndex(["x", "y"], "t", BS, fetch=lambda s, _: {
        "block_size": BS, "keys": set(keys[:2]) if s == "x" else set(keys), "ttl_s": 600.0})
    eng.reuse.index.refresh()  # head-wise: only keys every server kept count (the first two)
    eng.add("a", prompt)
    out, meta = eng.step()
    blocks = eng.blocks("a")
    assert out.has_sync_kv_loads and out.num_scheduled_tokens == {"a": 100 - 64}
    assert meta.restores == [(keys[0], blocks[0]), (keys[1], blocks[1])]
    assert meta.reg_block_ids == []  # restored blocks are registered by the servers themselves
    _, meta = eng.step()
    assert meta.reg_block_ids == [blocks[2]] and meta.reg_keys == [keys[2]]
    assert eng.reuse.num_restored_tokens == 64


def test_a_fully_retained_prompt_still_leaves_its_last_token_to_compute(vllm_config):
    prompt = _prompt(96, 4)  # exactly 3 blocks, all retained
    eng = Engine(vllm_config, [set(), set()])
    keys = set(chain_keys(prompt, BS, eng.salt))
    eng.reuse.index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": BS, "keys": keys, "ttl_s": 9.0})
    eng.reuse.index.refresh()
    eng.add("a", prompt)
    out, meta = eng.step()
    assert out.num_scheduled_tokens == {"a": 32} and len(meta.restores) == 2


def test_a_retained_block_after_a_missing_one_does_not_match(vllm_config):
    prompt = _prompt(100, 5)
    eng = Engine(vllm_config, [set(), set()])
    keys = chain_keys(prompt, BS, eng.salt)
    eng.reuse.index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": BS, "keys": {keys[1], keys[2]},
                                                                        "ttl_s": 9.0})
    eng.reuse.index.refresh()
    eng.add("a", prompt)
    out, meta = eng.step()
    assert out.num_scheduled_tokens == {"a": 100} and meta.restores == []


def test_a_block_whose_restore_failed_is_recomputed_then_registered(vllm_config):
    prompt = _prompt(100, 6)
    eng = Engine(vllm_config, [set(), set()])
    keys = chain_keys(prompt, BS, eng.salt)
    eng.reuse.index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": BS, "keys": set(keys),
                                                                        "ttl_s": 9.0})
    eng.reuse.index.refresh()
    eng.add("a", prompt)
    out = eng.sched.schedule()  # STEP (1a) all 3 full blocks are retained: restore them, compute 4 tokens
    meta = out.kv_connector_metadata.reuse
    blocks_before = eng.blocks("a")
    assert [b for _, b in meta.restores] == blocks_before[:3] and out.num_scheduled_tokens == {"a": 4}
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    # STEP (1c) the worker reports block 1 as not restored (a miss on some server)
    eng.sched.update_from_output(out, ModelRunnerOutput(
        req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[7]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={blocks_before[1]})))
    req = eng.sched.requests["a"]
    assert req.num_computed_tokens == 32 and req.num_output_tokens == 0  # the step's token was dropped
    out, meta = eng.step()  # STEP (2) recompute from block 1: nothing restored, nothing registered yet
    assert out.num_scheduled_tokens == {"a": 100 - 32} and meta.restores == [] and meta.reg_block_ids == []
    _, meta = eng.step()  # STEP (3) blocks 1 and 2 now hold recomputed KV
    assert meta.reg_block_ids == blocks_before[1:3] and meta.reg_keys == keys[1:3]


def test_a_finished_requests_last_full_block_is_registered_in_the_next_step(vllm_config):
    eng = Engine(vllm_config, [set(), set()])
    prompt = _prompt(31, 7)
    eng.add("a", prompt, max_tokens=2)
    eng.step()  # prefill 31 tokens
    eng.step()  # decode token 31: block 0 becomes full, and the request finishes
    assert "a" not in eng.sched.requests
    out, meta = eng.step()  # an empty step still carries the registration to the servers
    assert out.num_scheduled_tokens == {}
    assert meta.reg_keys == chain_keys([*prompt, 7], BS, eng.salt) and len(meta.reg_block_ids) == 1


def test_request_wise_a_chain_matches_on_one_server_and_restores_name_their_request(vllm_config):
    eng = Engine(vllm_config, [set(), set()])
    prompt = _prompt(100, 8)
    keys = chain_keys(prompt, BS, eng.salt)
    kept = {"x": {keys[0], keys[1]}, "y": {keys[0], keys[2]}}  # the union would be all 3: not a chain anywhere
    eng.reuse.index = RetainedIndex(["x", "y"], "t", BS, partition="request",
                                    fetch=lambda s, _: {"block_size": BS, "keys": kept[s], "ttl_s": 9.0})
    eng.reuse.index.refresh()
    eng.add("a", prompt)
    out, meta = eng.step()
    blocks = eng.blocks("a")
    assert out.num_scheduled_tokens == {"a": 100 - 64}
    assert meta.restores == [(keys[0], blocks[0]), (keys[1], blocks[1])]
    assert meta.restore_owners == [blocks[0]] * 2  # the client places request "a" by its first block


def test_without_the_recompute_policy_nothing_is_matched_but_blocks_are_still_registered(vllm_config):
    eng = Engine(vllm_config, [set(), set()], policy="fail")
    prompt = _prompt(100, 10)
    keys = chain_keys(prompt, BS, eng.salt)
    eng.reuse.index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": BS, "keys": set(keys),
                                                                        "ttl_s": 9.0})
    eng.reuse.index.refresh()
    assert not eng.reuse.lookup  # a block expiring after the lookup would fail its request under "fail"
    eng.add("a", prompt)
    out, meta = eng.step()
    assert out.num_scheduled_tokens == {"a": 100} and meta.restores == []
    _, meta = eng.step()
    assert meta.reg_keys == keys


def test_servers_that_kept_another_block_size_or_expired_keys_match_nothing(vllm_config):
    keys = {bytes(16)}
    index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": 16, "keys": keys, "ttl_s": 9.0})
    index.refresh()
    assert index.current() == frozenset()
    index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": BS, "keys": keys, "ttl_s": 0.0})
    index.refresh()
    assert index.current() == frozenset()


def test_an_unreachable_server_means_no_reuse_and_the_lookup_is_retried_later(monkeypatch):
    from vllm_disagg.errors import DisaggError
    from vllm_disagg.kv.lamina import reuse

    calls = []

    def fetch(server, token):
        calls.append(server)
        if len(calls) == 1:  # nothing listens on port 9
            return reuse.fetch_retained("127.0.0.1:9", token, 1.0)
        return {"block_size": BS, "keys": {bytes(16)}, "ttl_s": 9.0}

    monkeypatch.setattr(reuse, "_RETRY_S", 0.0)
    index = RetainedIndex(["x"], "t", BS, fetch=fetch)
    index.refresh()
    assert index.keys == frozenset() and len(calls) == 1
    assert index.current() == {bytes(16)} and len(calls) == 2  # retried once due, then kept
    assert index.current() == {bytes(16)} and len(calls) == 2
    monkeypatch.setattr(reuse, "_RETRY_WINDOW_S", 0.0)  # past the window a failed lookup is final
    calls.clear()
    index = RetainedIndex(["x"], "t", BS, fetch=fetch)
    index.refresh()
    assert index.current() == frozenset() and len(calls) == 1
    with pytest.raises(DisaggError, match="kv/retained"):
        reuse.fetch_retained("127.0.0.1:9", "t", 1.0)


# ---------------------------------------------------------------- the worker half against real servers
def _step_meta(lengths: list[int], starts: list[int], tables: list[list[int]]):
    """A step where request r computes tokens [starts[r], lengths[r]) with block table tables[r]."""
    import torch

    from vllm_disagg.attention import wire
    from vllm_disagg.attention.client import ClientMeta

    qlens = [n - s for n, s in zip(lengths, starts)]
    cols = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (cols - len(t)) for t in tables], dtype=torch.int32)
    slots = torch.tensor([tables[r][p // BS] * BS + p % BS for r in range(len(lengths))
                          for p in range(starts[r], lengths[r])])
    qsl = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
    step = wire.StepMeta(qsl, torch.tensor(lengths, dtype=torch.int32), table, slots)
    return ClientMeta(step, max_query_len=max(qlens), num_actual_tokens=sum(qlens))


def _run_step(client, meta):
    import torch

    n = meta.num_actual_tokens
    for layer in range(2):
        client.attend(layer, torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32), meta, 0.2,
                      torch.empty(n, 4, 32))


def test_the_worker_half_registers_through_step_frames_and_reports_blocks_it_could_not_restore():
    from vllm_disagg.attention.client import DisaggAttentionClient
    from vllm_disagg.attention.server import DisaggAttentionServer
    from vllm_disagg.errors import DisaggError
    from vllm_disagg.kv.lamina.reuse import DisaggReuseWorker, ReuseMeta, fetch_retained

    token = "reuse-token"
    geom = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_size=32, block_size=BS, dtype="float32",
                max_num_tokens=256)
    servers = [DisaggAttentionServer(transport="tcp", kv_cache_bytes=4 << 20, auth_token=token) for _ in range(2)]
    https = [s.start()["http"] for s in servers]
    try:
        client = DisaggAttentionClient(https, transport="tcp", partition="head", auth_token=token)
        client.connect(**geom)
        worker = DisaggReuseWorker(5.0, client=lambda: client)
        keys = chain_keys(_prompt(64, 9), BS, SALT)
        worker.bind(ReuseMeta())  # STEP (1) prefill 70 tokens into blocks 1, 2, 3
        _run_step(client, _step_meta([70], [0], [[1, 2, 3]]))
        worker.bind(ReuseMeta(reg_block_ids=[1, 2], reg_keys=keys, reg_owners=[1, 1]))
        worker.start_load()  # STEP (2) decode: the registrations ride on this step's meta frame
        _run_step(client, _step_meta([71], [70], [[1, 2, 3]]))
        client.close()  # the model worker is gone; a new one connects with the same geometry

        client = DisaggAttentionClient(https, transport="tcp", partition="head", auth_token=token)
        client.connect(**geom)
        for http in https:
            kept = fetch_retained(http, token)
            assert kept["keys"] == set(keys) and kept["block_size"] == BS and 0 < kept["ttl_s"] <= 600
        with pytest.raises(DisaggError, match="401"):
            fetch_retained(https[0], "wrong-token")
        worker = DisaggReuseWorker(5.0, client=lambda: client)
        missing = bytes(range(16))
        worker.bind(ReuseMeta(restores=[(keys[0], 5), (keys[1], 6), (missing, 7)]))
        worker.start_load()
        assert worker.take_load_errors() == {7} and worker.take_load_errors() == set()
        assert (worker.num_restored_blocks, worker.num_failed_blocks) == (2, 1)
        client.close()
    finally:
        for s in servers:
            s.stop()


# ---------------------------------------------------------------- P/D requests (a prefill instance pushes)
def _add_pd(eng: Engine, req_id: str, prompt: list[int]):
    """A decode-side P/D request, as the router sends it to D (`kv_transfer_params.do_remote_prefill`)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0, extra_args={"kv_transfer_params": {
        "do_remote_prefill": True, "transfer_id": f"tid-{req_id}", "remote_host": "127.0.0.1", "remote_port": 9}})
    sp.update_from_generation_config({}, None)
    eng.sched.add_request(Request(req_id, prompt, sp, None))


def _retain(eng: Engine, keys) -> None:
    eng.reuse.index = RetainedIndex(["x"], "t", BS, fetch=lambda s, _: {"block_size": BS, "keys": set(keys),
                                                                        "ttl_s": 9.0})
    eng.reuse.index.refresh()


def test_a_pd_request_is_pushed_then_its_full_blocks_register_once_it_runs(vllm_config):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    eng = Engine(vllm_config, [set(), set()])
    prompt = _prompt(100, 20)
    _add_pd(eng, "a", prompt)
    out = eng.sched.schedule()  # STEP (1) allocate, register the push with the prefill instance
    [spec] = out.kv_connector_metadata.recv_specs
    assert out.num_scheduled_tokens == {} and spec.block_ids == tuple(eng.blocks("a"))
    assert out.kv_connector_metadata.reuse.restores == []
    eng.sched.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                                                        kv_connector_output=KVConnectorOutput(
                                                            finished_recving={"a"})))  # the push landed
    out, meta = eng.step()  # STEP (2) the pushed prompt's full blocks are on the servers: register them
    assert "a" in out.num_scheduled_tokens
    assert meta.reg_block_ids == eng.blocks("a")[:3] and meta.reg_keys == chain_keys(prompt, BS, eng.salt)


def test_a_replayed_pd_request_whose_blocks_were_kept_is_restored_instead_of_pushed(vllm_config):
    """The router replays prompt + generated ids through P and D after the model worker restarted: D
    restores what the servers kept and computes the tail, registering nothing with the prefill side."""
    eng = Engine(vllm_config, [set(), set()])
    replayed = _prompt(150, 21)  # blocks 0-3 full, 22 tokens in block 4
    keys = chain_keys(replayed, BS, eng.salt)
    _retain(eng, keys[:3])  # block 3 was filled by the last step before the kill: never registered
    _add_pd(eng, "a", replayed)
    out, meta = eng.step()
    blocks = eng.blocks("a")
    assert out.kv_connector_metadata.recv_specs == []
    assert out.has_sync_kv_loads and out.num_scheduled_tokens == {"a": 150 - 96}
    assert meta.restores == [(k, b) for k, b in zip(keys[:3], blocks[:3])]
    _, meta = eng.step()  # the tail's full block registers like any other
    assert meta.reg_block_ids == [blocks[3]] and meta.reg_keys == [keys[3]]


def test_a_pd_request_with_a_short_retained_prefix_waits_for_its_push(vllm_config):
    """Computing most of a prompt on D would defeat P/D: a match that leaves more than two blocks
    to compute is not taken, and the whole prompt is pushed."""
    eng = Engine(vllm_config, [set(), set()])
    prompt = _prompt(150, 22)
    _retain(eng, chain_keys(prompt, BS, eng.salt)[:1])  # a shared first block only
    _add_pd(eng, "a", prompt)
    out, meta = eng.step()
    [spec] = out.kv_connector_metadata.recv_specs
    assert spec.block_ids == tuple(eng.blocks("a")) and meta.restores == [] and out.num_scheduled_tokens == {}
