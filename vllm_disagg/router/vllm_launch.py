# SPDX-License-Identifier: Apache-2.0
"""`vllm launch disagg-proxy` and `vllm launch disagg-attn-server`: vllm-disagg's `vllm launch` components.

vLLM discovers `vllm launch` components through `LaunchSubcommandBase.__subclasses__()` (hooks notes
§1.2, undocumented behaviour pinned by a test): importing this module in the CLI process is all it takes.
`vllm_disagg.router.register()` does that, and only when vLLM's CLI has loaded `launch`.
The serve arguments come along (vLLM validates them); only --host/--port are used from them (the router's
endpoint; the attention server's /health and /metrics).
"""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.launch import LaunchSubcommandBase

from vllm_disagg.router.cli import add_router_args, config_from_args, scheduler_config_from_args


class DisaggProxySubcommand(LaunchSubcommandBase):
    """`vllm launch disagg-proxy` starts the vllm-disagg Splitwise router (P/D pools, one endpoint).

    ```bash
    vllm launch disagg-proxy --prefill http://127.0.0.1:8100 --prefill-kv 127.0.0.1:9100 \\
        --decode http://127.0.0.1:8200 --port 8000
    ```
    """

    name = "disagg-proxy"
    help = "Launch the vllm-disagg Splitwise router in front of prefill/decode pools."

    @classmethod
    def add_cli_args(cls, parser) -> None:
        super().add_cli_args(parser)
        add_router_args(parser, vllm_serve_flags=True)

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        from vllm_disagg.observe import tracing
        from vllm_disagg.router.server import run_router

        tracing.configure("vllm-disagg-router", args.otlp_traces_endpoint, args.trace_sample_ratio)
        try:
            run_router(config_from_args(args), args.host or "127.0.0.1", args.port,
                       scheduler_config_from_args(args))
        finally:
            tracing.shutdown()


class DisaggAttnServerSubcommand(LaunchSubcommandBase):
    """`vllm launch disagg-attn-server` runs one Lamina attention server (= `vllm-disagg attn-server`).

    It owns a KV shard and computes decode attention for a remote-attention model worker.
    --host/--port are its HTTP address (/health, /metrics); --data-port pins the data listener.

    ```bash
    VLLM_DISAGG_AUTH_TOKEN=secret vllm launch disagg-attn-server --transport tcp --host 0.0.0.0 \\
        --port 8301 --data-port 9301 --kv-cache-gib 4
    ```
    """

    name = "disagg-attn-server"
    help = "Launch a vllm-disagg (Lamina) attention server that owns a KV shard."

    @classmethod
    def add_cli_args(cls, parser) -> None:
        from vllm_disagg.attention.cli import add_server_args

        super().add_cli_args(parser)
        add_server_args(parser, with_host_port=False)

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        import sys

        from vllm_disagg.attention.cli import run

        args.host = args.host or "127.0.0.1"
        args.http_port = args.port
        sys.exit(run(args))
