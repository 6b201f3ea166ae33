# SPDX-License-Identifier: Apache-2.0
"""A chaos run whose load stopped early says so (two soaks once ended short with nothing said)."""

import time

import pytest

from vllm_disagg.testing.chaos.campaign import _send, load_check
from vllm_disagg.testing.chaos.clients import ChaosClients


def test_a_whole_load_is_complete_and_a_short_one_is_not():
    assert load_check(10, 10, False, [])["load_complete"]
    assert not load_check(10, 7, False, [])["load_complete"]
    assert not load_check(10, 10, True, [])["load_complete"]
    short = load_check(10, 10, False, ["ValueError: boom"])
    assert not short["load_complete"] and short["sender_errors"] == ["ValueError: boom"]


def test_a_sender_that_dies_leaves_its_error_for_the_report():
    clients = ChaosClients("http://127.0.0.1:9", "m", {})
    errors: list[str] = []
    with pytest.raises(AttributeError):
        _send(clients, [object()], time.monotonic(), time.monotonic() + 1, errors)  # not a ChaosRequest
    clients.close()
    assert errors and errors[0].startswith("AttributeError")
