# SPDX-License-Identifier: Apache-2.0
"""P/D disaggregation with nano-batching on one side: the layer-wise KV push still carries exact KV.

Same setup as test_pd_connector.py (real prefill and decode engines in separate processes, KV
pushed layer by layer over tcp, greedy float32 tokens compared with a plain engine), with one side
on the NanoFlow worker (2 nano-batches). With nano-batching, vLLM's per-layer save hook fires once
per nano-batch; the prefill side must push a layer only once *every* nano-batch has written it
(a request may even straddle two nano-batches: 1100-token prompts in 2048-token steps).
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import test_pd_connector as pd

pytestmark = pytest.mark.slow

NANO_CHILD = str(Path(__file__).with_name("nanoflow_pd_child.py"))
prompts = pd.prompts  # module-scoped fixtures shared with test_pd_connector
log_dir = pd.log_dir
baseline = pd.baseline


def _engine(role: str, model_dir: str, log_dir: Path, cpu: str, **opts) -> pd.Engine:
    with mock.patch.object(pd, "CHILD", NANO_CHILD):  # Engine reads the child path when it starts
        return pd.Engine(role, model_dir, log_dir, cpu, **opts)


def _assert_nano_batched(out: dict, role: str) -> None:
    stats = out.get("nano_stats") or {}
    assert stats.get("pipeline_steps", 0) > 0 and not stats.get("fallback_steps"), (
        f"{role} did not run nano-batched steps: {stats}"
    )


@pytest.mark.parametrize("nano_side", ["decode", "prefill"])
def test_pd_with_one_side_nano_batched_gives_plain_vllm_tokens_without_recompute(
    nano_side, tiny_model_dir, prompts, baseline, log_dir
):
    # on P, delay every later nano-batch's attention (its KV write): a push of a layer after only
    # the first nano-batch wrote it would read stale KV for the tokens of the second one
    nano = {"nano_batches": 2, "late_nano_delay_s": 0.2 if nano_side == "prefill" else 0.0}
    p_port = pd._free_port()
    prefill = _engine(
        "prefill",
        tiny_model_dir,
        log_dir,
        "0",
        kv_port=p_port,
        threshold=256,
        **(nano if nano_side == "prefill" else {}),
    )
    decode = _engine(
        "decode",
        tiny_model_dir,
        log_dir,
        "1",
        kv_port=pd._free_port(),
        policy="recompute",
        **(nano if nano_side == "decode" else {}),
    )
    try:
        _, d_out = pd._run_pd(prefill, decode, p_port, prompts)
        p_out = prefill.result()
        assert "recomputes the prompt" not in decode.log_text(), "a push failed; see the decode log"
        assert d_out["outputs"] == baseline, f"{nano_side} nano-batched: decode tokens differ from plain vLLM"
        _assert_nano_batched(d_out if nano_side == "decode" else p_out, nano_side)
        assert p_out["kv_writes_checked"] > 0
        assert p_out["kv_writes_stale"] == 0, (
            "the prefill side pushed KV blocks before every nano-batch wrote them"
        )
        pushes = p_out["timeline"]
        assert len(pushes) == pd.NUM_REQS and all(p["layerwise"] for p in pushes)
        assert p_out["free_blocks"] == prefill.ready["free_blocks"], "prefill leaked KV blocks"
        assert d_out["free_blocks"] == decode.ready["free_blocks"], "decode leaked KV blocks"
    finally:
        prefill.close()
        decode.close()
