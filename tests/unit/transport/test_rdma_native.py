# SPDX-License-Identifier: Apache-2.0
"""The rdma cases (`tests/rdma/rdma_cases.py`) on a native ibverbs device, when the machine has one
(real NIC, or a stock kernel with `rdma link add rxe0 type rxe netdev <if>`). Elsewhere the same
cases run inside the soft-RoCE VM (`tests/integration/test_softroce_vm.py`)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from vllm_disagg.transport.rdma import probe_ibverbs

pytestmark = pytest.mark.rdma

_CASES_PATH = pathlib.Path(__file__).resolve().parents[2] / "rdma" / "rdma_cases.py"
_spec = importlib.util.spec_from_file_location("rdma_cases", _CASES_PATH)
rdma_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rdma_cases)
_REASON = probe_ibverbs()


@pytest.mark.skipif(_REASON is not None, reason=f"no native ibverbs device: {_REASON}")
@pytest.mark.parametrize("name", sorted(rdma_cases.CASES))
def test_rdma_case_passes_on_the_native_device(name):
    rdma_cases.CASES[name]()
