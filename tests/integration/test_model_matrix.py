# SPDX-License-Identifier: Apache-2.0
"""The model matrix: every tiny family (`vllm_disagg/testing/families.py`) through every mechanism
gives plain vLLM's greedy float32 tokens on multi-block prompts, and each cell proves its mechanism
ran (attention servers answered ATTN frames, nano-batched steps ran, layer-wise pushes landed with
no recompute). Where a prompt is longer than a family's sliding window, the window is shown to
matter (the same weights with full attention give other tokens). Cells that refuse check the one
line they refuse with (`REFUSED`). CI runs one family per attention feature (`CI_CELLS`, ~2 min);
`VLLM_DISAGG_FULL_MATRIX=1` runs every cell here, and `benchmarks/model_matrix.py` runs every cell
and writes the result that makes the README's compatibility table."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_disagg.testing.families import FAMILIES, make_tiny_model
from vllm_disagg.testing.matrix import PROMPTS, CellRefused, generate, run_in_process, run_pd

pytestmark = pytest.mark.slow
os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "test-token")

FULL = os.environ.get("VLLM_DISAGG_FULL_MATRIX") == "1"
IN_PROCESS = ("remote_head", "remote_request", "nano2")
# one family per attention feature: soft-cap + alternating windows (gemma2, also off the Llama op
# path for nano-batches), ALiBi (bloom), sinks + MoE request-wise (gpt_oss), request-wise placement of
# a model whose every layer is windowed (mistral: its windows allocated in full)
CI_CELLS = (("gemma2", "remote_head"), ("gemma2", "nano2"), ("bloom", "remote_head"),
            ("gpt_oss", "remote_request"), ("mistral", "remote_request"))
CELLS = [(f, m) for f in sorted(FAMILIES) for m in IN_PROCESS] if FULL else list(CI_CELLS)
PD_FAMILIES = sorted(FAMILIES) if FULL else ["gemma2"]  # hybrid windows + soft-cap through the push
HYBRID_FAMILIES = ["gemma2", "gpt_oss"] if FULL else ["gemma2"]  # full and sliding-window KV cache groups
WINDOW_FAMILIES = sorted(f for f, fam in FAMILIES.items() if fam.sliding_window) if FULL else ["gemma2", "mistral"]
# cells that refuse at start, and the reason they must give (none today: the README's table)
REFUSED: dict[tuple[str, str], str] = {}

_models: dict[str, str] = {}
_plain: dict[str, list] = {}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("matrix")


def _model(root, family: str) -> str:
    if family not in _models:
        _models[family] = str(make_tiny_model(family, root / family))
    return _models[family]


def _baseline(root, family: str) -> list:
    if family not in _plain:
        _plain[family] = generate(_model(root, family))
    return _plain[family]


@pytest.fixture(scope="module")
def servers():
    from vllm_disagg.testing.attention import start_local_servers

    srv = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    yield [s.http for s in srv]
    for s in srv:
        s.stop()


@pytest.mark.parametrize(("family", "mechanism"), CELLS)
def test_family_through_mechanism_gives_plain_vllms_tokens(model_root, servers, family, mechanism):
    refused = REFUSED.get((family, mechanism))
    if refused is not None:
        with pytest.raises(CellRefused, match=refused):
            run_in_process(mechanism, _model(model_root, family), servers)
        return
    want = _baseline(model_root, family)
    got, evidence = run_in_process(mechanism, _model(model_root, family), servers)
    assert got == want, f"{family} / {mechanism}: {evidence}"
    if mechanism.startswith("remote_"):
        assert evidence["attn_messages"] > 0, "the attention servers computed nothing"
    else:
        assert evidence["stats"]["nano_steps"] > 0, f"no nano-batched step ran: {evidence}"


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_the_sliding_window_matters_on_these_prompts(model_root, family):
    fam = FAMILIES[family]
    assert max(len(p) for p in PROMPTS) > fam.sliding_window
    full = make_tiny_model(family, model_root / f"{family}-full", **fam.full_attention_overrides())
    assert generate(full) != _baseline(model_root, family), "the same weights without the window: same tokens"


@pytest.mark.parametrize("family", PD_FAMILIES)
def test_prefill_decode_push_gives_plain_vllms_tokens(model_root, tmp_path, family):
    from vllm_disagg.launch.instances import free_ports

    got, evidence = run_pd(_model(model_root, family), tmp_path, free_ports(1)[0])
    assert got == _baseline(model_root, family), evidence
    assert evidence["layerwise"] == len(PROMPTS) and not evidence["recomputed"], evidence
    # vLLM's hybrid allocator stays on under the push (SupportsHMA): one KV cache group per attention type
    windowed = FAMILIES[family].sliding_window is not None
    hybrid = windowed and family != "mistral"
    assert evidence["kv_cache_groups"] == ([2, 2] if hybrid else [1, 1]), evidence
    info = evidence["handshake"]  # a windowed group's layers push only the blocks their window still needs
    every_block = sum(-(-len(p) // info["block_size"]) for p in PROMPTS) * info["num_layers"] * info["block_nbytes"]
    assert (evidence["bytes_pushed"] < every_block) if windowed else (evidence["bytes_pushed"] == every_block)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_chunked_prefill_pushes_each_windowed_layer_only_its_window_and_d_verifies_every_block(
        model_root, tmp_path, family):
    """P prefills 300-token prompts in 32-token chunks, so vLLM frees its windowed layers' early blocks
    while the push runs; D registers only its window's blocks for those layers and checks every pushed
    block's CRC against P's (kv.verify_checksums) before decoding. A second round shares prefixes with
    the first, so D (prefix caching on) registers each group from past its own cache hit."""
    from vllm_disagg.launch.instances import free_ports
    from vllm_disagg.testing.matrix import run_pd_rounds
    from vllm_disagg.testing.models import token_prompts

    first = [p["prompt_token_ids"] for p in token_prompts(2, 300, seed=5) + token_prompts(1, 170, seed=6)]
    tails = [p["prompt_token_ids"] for p in token_prompts(2, 60, seed=7)]
    second = [first[0][:256] + tails[0], first[1][:200] + tails[1]]
    model = _model(model_root, family)
    got, evidence = run_pd_rounds(model, tmp_path, free_ports(1)[0], [first, second], prefill_opts={"mnbt": 32},
                                  decode_opts={"verify": True, "prefix_caching": True})
    assert got == [generate(model, prompts=first), generate(model, prompts=second)], evidence
    assert not evidence["recomputed"] and not evidence["checksum_mismatch"], evidence
    info = evidence["handshake"]
    blocks = [-(-len(p) // info["block_size"]) for p in first + second]
    assert evidence["kv_cache_groups"] == [2, 2] and evidence["bytes_pushed"] < sum(blocks) * info["num_layers"] * info["block_nbytes"]


@pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                    reason="this CPU has neither AVX-512 nor AMX: vLLM's CPU kernel refuses an fp8 KV cache")
def test_an_fp8_kv_cache_on_the_attention_servers_gives_local_fp8s_tokens(model_root, servers):
    import json
    import urllib.request

    from vllm_disagg.testing.matrix import remote_kwargs

    llama = _model(model_root, "llama")
    want = generate(llama, kv_cache_dtype="fp8")
    assert generate(llama, kv_cache_dtype="fp8", **remote_kwargs(servers, "head")) == want
    for http in servers:  # the servers really stored fp8 (one byte per value)
        with urllib.request.urlopen(f"http://{http}/health", timeout=10) as r:
            assert json.loads(r.read())["kv_cache_dtype"] == "fp8"


def test_moe_nano_batches_take_turns_around_remote_attention(model_root, servers):
    """Off the Llama op path (here MoE), one nano-batch's experts run while the other waits for its
    attention servers (nanoflow/pingpong.py), and the tokens stay plain vLLM's."""
    from vllm_disagg.testing.matrix import remote_nano2

    got, evidence = remote_nano2(_model(model_root, "qwen3_moe"), servers)
    assert got == _baseline(model_root, "qwen3_moe")
    assert evidence["stats"]["turn_steps"] > 0 and "turn taking" in evidence["stats"]["overlap"], evidence
