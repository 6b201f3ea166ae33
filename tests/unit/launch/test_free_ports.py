# SPDX-License-Identifier: Apache-2.0
"""`free_ports` picks below the ephemeral range, so a sibling engine's bind(0) cannot take them."""

import socket

from vllm_disagg.launch.local import HOST, _static_port_range, free_ports


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = _static_port_range()
    ports = free_ports(12)
    assert len(set(ports)) == 12
    if high > low:
        assert all(low <= p < high for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind((HOST, p))


def test_a_taken_port_is_skipped():
    with socket.socket() as held:
        held.bind((HOST, free_ports(1)[0]))
        taken = held.getsockname()[1]
        assert all(taken not in free_ports(4) for _ in range(20))


def test_excluded_ports_are_never_handed_out():
    """An earlier draw's ports are free until their instance binds them: a later draw must skip them
    (CI, stop 45: attention1's KV port was attention0's HTTP port)."""
    earlier = set(free_ports(12))
    for _ in range(30):
        assert earlier.isdisjoint(free_ports(4, exclude=earlier))
