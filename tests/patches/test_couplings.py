# SPDX-License-Identifier: Apache-2.0
"""Upstream couplings: fails when vLLM's version changed and a coupling was not re-read.

To fix a failure: read each listed upstream symbol in the new vLLM, adapt the plugin code named
in `users`, then bump `checked_against` (and `params`) in `patches/couplings.py`."""

import importlib

import pytest

pytest.importorskip("vllm")

from vllm_disagg.patches.compat import vllm_version  # noqa: E402
from vllm_disagg.patches.couplings import COUPLINGS  # noqa: E402

INSTALLED = vllm_version().split("+")[0]


@pytest.mark.parametrize("coupling", COUPLINGS, ids=lambda c: c.symbol.split(":")[1])
def test_every_coupling_was_checked_against_the_installed_vllm(coupling):
    assert coupling.checked_against == INSTALLED, (
        f"vLLM is {INSTALLED} but {coupling.symbol} was last checked against {coupling.checked_against}: "
        f"re-read it, adapt {', '.join(coupling.users)}, then bump checked_against")


@pytest.mark.parametrize("coupling", COUPLINGS, ids=lambda c: c.symbol.split(":")[1])
def test_the_upstream_symbol_still_takes_what_it_took(coupling):
    assert coupling.current_params() == coupling.params, coupling.symbol


@pytest.mark.parametrize("coupling", COUPLINGS, ids=lambda c: c.symbol.split(":")[1])
def test_the_users_named_exist(coupling):
    for user in coupling.users:
        parts = user.split(".")
        for cut in range(len(parts), 0, -1):  # longest importable module prefix, then attributes
            try:
                obj = importlib.import_module("vllm_disagg." + ".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
