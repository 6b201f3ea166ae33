# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg`: the plugin's own commands.

Each subcommand lives in the package folder of its concept and exposes
`add_parser(subparsers)`, which adds one parser and sets `func(args) -> int`.
Modules are imported only when listed here, so `vllm-disagg --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order in `--help`.
SUBCOMMAND_MODULES = [
    "vllm_disagg.cli.serve",  # serve: `vllm serve` with --plugin disagg
    "vllm_disagg.cli.model",  # model pull|path|list
    "vllm_disagg.router.cli",  # router: Splitwise OpenAI front end over P/D pools
    "vllm_disagg.launch.cli",  # up: local P/D pools + router
    "vllm_disagg.planner.cli",  # plan nanoflow|lamina|splitwise: analytic models + simulator
    "vllm_disagg.nanoflow.tune",  # tune: profile ops, search a NanoFlow nano-batch plan
    "vllm_disagg.transport.doctor",  # doctor: which transports can run here, and why not
    "vllm_disagg.attention.cli",  # attn-server: a Lamina attention server (owns a KV shard)
    "vllm_disagg.launch.status",  # status: pools, health and load of a running deployment
    "vllm_disagg.launch.logs",  # logs: every process's log of a deployment, merged (--follow)
    "vllm_disagg.observe.cli",  # trace: where one request's time went (text waterfall)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-disagg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def _version() -> str:
    from vllm_disagg import __version__

    return f"vllm-disagg {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # `serve` hands the whole command line to vLLM's own parser.
        from vllm_disagg.cli.serve import run_vllm_serve

        return run_vllm_serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
