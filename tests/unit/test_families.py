# SPDX-License-Identifier: Apache-2.0
"""The model matrix's tiny families: each writes a checkpoint its transformers class reads back, with
seeded weights under which the output depends on the context (what the equivalence tests need)."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_disagg.testing.families import FAMILIES, WINDOW, make_tiny_model

PROMPT = list(range(3, 3 + 100))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_writes_a_seeded_checkpoint_whose_output_depends_on_the_context(tmp_path, name):
    from transformers import AutoModelForCausalLM

    out = make_tiny_model(name, tmp_path / name, seed=3)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == FAMILIES[name].model_type
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    changed = list(PROMPT)
    changed[100 - WINDOW // 2] += 1  # inside every sliding window
    with torch.no_grad():
        a, b = (model(torch.tensor([p])).logits[0, -1] for p in (PROMPT, changed))
    assert (a - b).abs().max() > 0.02 * a.std(), "one context token should move the next token's logits"
    again = make_tiny_model(name, tmp_path / "again", seed=3)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_full_attention_overrides_drop_every_window():
    for fam in FAMILIES.values():
        over = fam.full_attention_overrides()
        if fam.sliding_window is None:
            assert over == {}
        else:
            assert over == {"sliding_window": 4096}
