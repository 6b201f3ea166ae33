# SPDX-License-Identifier: Apache-2.0
"""mscclpp is GPU-only: importing its backend is always safe, selecting it without CUDA/mscclpp
fails at once with one line saying what is missing (never a fallback)."""

from __future__ import annotations

import importlib
import sys

import pytest

from vllm_disagg.errors import TransportUnavailable
from vllm_disagg.transport import TransportKind, TransportOptions


def test_importing_the_mscclpp_backend_needs_neither_cuda_nor_mscclpp():
    mod = importlib.import_module("vllm_disagg.transport.mscclpp")
    assert "mscclpp" not in sys.modules or sys.modules["mscclpp"] is not None
    assert hasattr(mod, "MscclppTransport")


def test_selecting_mscclpp_without_a_gpu_fails_with_one_clear_line():
    from vllm_disagg.transport.mscclpp import MscclppTransport, probe_mscclpp

    reason = MscclppTransport.unavailable_reason()
    assert isinstance(reason, str) and "\n" not in reason
    if probe_mscclpp() is not None:
        assert reason.startswith("mscclpp is GPU-only: ")
        assert "CUDA" in reason or "mscclpp not installed" in reason
    with pytest.raises(TransportUnavailable) as err:
        MscclppTransport(TransportOptions(auth_token="t"))
    assert "\n" not in str(err.value) and str(err.value).startswith("transport 'mscclpp' cannot run here: ")


def test_get_transport_mscclpp_raises_the_same_one_line_error():
    from vllm_disagg.transport import get_transport

    assert TransportKind("mscclpp") is TransportKind.MSCCLPP
    with pytest.raises(TransportUnavailable, match="^transport 'mscclpp' cannot run here: "):
        get_transport("mscclpp", TransportOptions(auth_token="t"))
