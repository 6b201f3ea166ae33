# SPDX-License-Identifier: Apache-2.0
"""Backend selection, capability reporting, `vllm-disagg doctor`, and the loopback state machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm_disagg.errors import AuthError, TransportUnavailable
from vllm_disagg.transport import BlockWrite, TransportOptions, XferState, available_transports, get_transport

OPTS = TransportOptions(auth_token="t", timeout_s=2.0)


def test_selecting_rdma_without_a_device_fails_at_start_up_with_one_line():
    with pytest.raises(TransportUnavailable) as info:
        get_transport("rdma", OPTS)
    message = str(info.value)
    assert "\n" not in message and message.startswith("transport 'rdma' cannot run here:")


def test_an_unknown_transport_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: tcp, shm, nixl, rdma, mscclpp, loopback"):
        get_transport("mooncake", OPTS)


def test_options_refuse_an_empty_token():
    with pytest.raises(ValueError, match="auth_token"):
        TransportOptions(auth_token="")


def test_importing_the_package_does_not_import_optional_backends():
    code = "import sys, vllm_disagg.transport; print('nixl' in sys.modules, 'pyverbs' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_available_transports_reports_every_kind_with_a_reason_when_it_cannot_run():
    report = available_transports()
    assert set(report) == {"tcp", "shm", "nixl", "rdma", "mscclpp", "loopback"}
    assert report["tcp"] is None and report["loopback"] is None
    assert isinstance(report["rdma"], str) and report["rdma"]


def test_doctor_prints_one_line_per_transport_and_exits_zero(capsys):
    import argparse

    from vllm_disagg.cli.main import SUBCOMMAND_MODULES
    from vllm_disagg.transport import doctor

    assert "vllm_disagg.transport.doctor" in SUBCOMMAND_MODULES
    sub = argparse.ArgumentParser().add_subparsers()
    doctor.add_parser(sub)
    assert doctor.run(argparse.Namespace(probe=False)) == 0
    kinds = {"tcp", "shm", "nixl", "rdma", "mscclpp", "loopback"}
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.split(":")[0] in kinds]
    assert len(lines) == 6 and any(ln.startswith("rdma: no - ") for ln in lines)
    assert any(ln.startswith("tcp: yes") for ln in lines)


def test_loopback_completes_the_same_state_machine_in_process():
    tr = get_transport("loopback", OPTS)
    rx = tr.kv_receiver("d")
    cache = torch.zeros(8, 16)
    rx.register_region("layer.0", cache)
    tx = tr.kv_sender("p")
    peer = tx.connect(rx.start())
    src = torch.randn(8, 16)
    h = peer.write_blocks([BlockWrite("layer.0", src, [0, 1], [6, 7])], "req", 0)
    assert h.state() is XferState.DONE
    n = rx.wait_notification(1)
    assert (n.peer, n.transfer_id, n.layer, n.seq) == ("p", "req", 0, 0)
    assert torch.equal(cache[6:], src[:2])
    rx.close()
    h = peer.write_blocks([BlockWrite("layer.0", src, [0], [0])], "late", 0)
    assert h.state() is XferState.FAILED
    other = tr.kv_receiver("d2")
    other.register_region("layer.0", torch.zeros(1, 4))
    with pytest.raises(AuthError):
        get_transport("loopback", TransportOptions(auth_token="other")).kv_sender().connect(other.start())
    other.close()
