# SPDX-License-Identifier: Apache-2.0
"""The README's model-family x mechanism table is what `make compat-table` makes of the committed
matrix result (benchmarks/results/model_matrix.json): edit neither by hand."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_disagg.testing.families import FAMILIES
from vllm_disagg.testing.matrix import MECHANISMS, RESULT_PATH, TABLE_END, compat_table, readme_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_generated_from_the_matrix_result():
    result = json.loads(RESULT_PATH.read_text())
    assert readme_table((ROOT / "README.md").read_text()) == compat_table(result), (
        "README's compatibility table drifted from benchmarks/results/model_matrix.json: run `make compat-table`")


def test_the_committed_result_covers_every_family_and_mechanism():
    result = json.loads(RESULT_PATH.read_text())
    assert set(result["families"]) == set(FAMILIES)
    for family in FAMILIES:
        assert set(MECHANISMS) <= set(result["cells"][family]), family
        for mechanism, cell in result["cells"][family].items():
            assert cell["status"] in ("ok", "refused", "failed"), f"{family} x {mechanism}: {cell}"
            if cell["status"] == "failed":  # a measured failure stays in the table, and the README says so
                known = (ROOT / "README.md").read_text().split(TABLE_END, 1)[1].split("\n## ", 1)[0]
                assert "Known bug" in known and family in known, (
                    f"{family} x {mechanism} failed in the committed matrix: name it under the table ('Known bug')")
