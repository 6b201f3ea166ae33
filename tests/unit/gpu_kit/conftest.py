# SPDX-License-Identifier: Apache-2.0
"""The GPU kit's modules live in benchmarks/ (gpu_check.py) and benchmarks/gpu/ (one per step)."""

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[3] / "benchmarks"
for _path in (_BENCH, _BENCH / "gpu"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
