# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg doctor`: which transports can run on this machine, and why not.

Default: capability checks only (imports, devices), one line per transport. `--probe` also moves
a few KV blocks through each available backend inside this process, to prove it end to end.
"""

from __future__ import annotations

import argparse

from vllm_disagg.transport import TransportKind, transport_class


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="report which transports can run here and why not")
    p.add_argument(
        "--probe", action="store_true", help="also push a few KV blocks through each available backend"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One line per backend, each backend answering for itself (`Transport.doctor`)."""
    for kind in TransportKind:
        try:
            line = transport_class(kind).doctor(probe=args.probe and kind is not TransportKind.LOOPBACK)
        except Exception as err:  # a broken optional dependency must not break the report
            line = f"no - import failed: {type(err).__name__}: {err}"
        print(f"{kind.value}: {line}")
    return 0
