# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg doctor`: which transports can run on this machine, and why not.

Default: capability checks only (imports, devices), one line per transport. `--probe` also moves
a few KV blocks through each available backend inside this process, to prove it end to end.
"""

from __future__ import annotations

import argparse
import os
import time

from vllm_disagg.transport import BlockWrite, TransportOptions, available_transports, get_transport

_NOTES = {
    "loopback": "in-process only (tests, warm-up)",
    "mscclpp": "KV push only; data path not yet verified on hardware (transport/mscclpp/README.md), try --probe",
    "shm": "same host",
    "tcp": "default",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="report which transports can run here and why not")
    p.add_argument(
        "--probe", action="store_true", help="also push a few KV blocks through each available backend"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for kind, reason in available_transports().items():
        if reason is not None:
            print(f"{kind}: no - {reason}")
            continue
        detail = _NOTES.get(kind) or _version(kind)
        if args.probe and kind != "loopback":
            detail += f"; probe: {_probe(kind)}"
        print(f"{kind}: yes ({detail})")
    return 0


def _version(kind: str) -> str:
    if kind == "nixl":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"nixl {version('nixl')}, UCX backend; UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', '<all>')}"
        except PackageNotFoundError:
            return "nixl"
    return ""


def _probe(kind: str) -> str:
    """Write 4 blocks to ourselves and check them; returns 'ok (N ms)' or the error."""
    import torch

    t0 = time.perf_counter()
    tr = get_transport(kind, TransportOptions(auth_token=os.urandom(8).hex(), timeout_s=10))
    rx, tx = tr.kv_receiver("doctor-rx"), None
    try:
        cache = torch.zeros(8, 1024)
        rx.register_region("probe", cache)
        tx = tr.kv_sender("doctor-tx")
        peer = tx.connect(rx.start(), timeout=10)
        src = torch.randn(8, 1024)
        peer.write_blocks([BlockWrite("probe", src, [0, 1, 2, 3], [4, 5, 6, 7])], "probe", 0).wait(10)
        rx.wait_notification(timeout=10)
        ok = torch.equal(cache[4:], src[:4])
        return f"ok ({(time.perf_counter() - t0) * 1e3:.0f} ms)" if ok else "FAILED: data mismatch"
    except Exception as err:  # report, don't crash the doctor
        return f"FAILED: {type(err).__name__}: {err}"
    finally:
        if tx is not None:
            tx.close()
        rx.close()
