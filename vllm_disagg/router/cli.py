# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg router`: the Splitwise cluster front end as a command.

    vllm-disagg router --prefill http://127.0.0.1:8100 --prefill-kv 127.0.0.1:9100 \\
                       --decode http://127.0.0.1:8200 --port 8000

`add_router_args` / `config_from_args` are shared with `vllm launch disagg-proxy` and the launcher.
"""

from __future__ import annotations

import argparse
import os

from vllm_disagg.router.config import RouterConfig


def add_router_args(parser: argparse.ArgumentParser, vllm_serve_flags: bool = False) -> None:
    """Pool membership, timeouts and policy thresholds (no --host/--port: callers own those).

    `vllm_serve_flags`: the parser already has `vllm serve`'s --api-key and --otlp-traces-endpoint
    (`vllm launch disagg-proxy`), which mean the same here."""
    g = parser.add_argument_group("disagg router")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="prefill (P) instance base URL; repeat per instance")
    g.add_argument("--prefill-kv", action="append", default=[], metavar="HOST:PORT",
                   help="KV side channel of each --prefill instance, same order")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="decode (D) instance base URL; repeat per instance")
    g.add_argument("--mixed", action="append", default=[], metavar="URL",
                   help="plain instance that serves whole requests (mixed pool)")
    g.add_argument("--pd-protocol", choices=("push", "vllm"), default="push",
                   help="push: ours (P and D at once, P pushes the KV; needs --prefill-kv); vllm: vLLM's own "
                        "connectors, e.g. NixlConnector (P first, then D with P's kv_transfer_params)")
    g.add_argument("--push-timeout-s", type=float, default=None,
                   help="tell D to recompute when the KV push stalls this long (default: D's config)")
    g.add_argument("--read-timeout-s", type=float, default=300.0,
                   help="longest silence from an instance before the request fails cleanly")
    g.add_argument("--health-interval-s", type=float, default=2.0, help="period of /health polls")
    add_failover_args(g)
    add_mixed_pool_args(g)
    if not vllm_serve_flags:
        add_api_key_arg(g)
    add_tracing_args(g, with_endpoint=not vllm_serve_flags)


def add_api_key_arg(g) -> None:
    """`--api-key` exactly as `vllm serve` takes it (`vllm-disagg up` adds the same)."""
    g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="clients must send 'Authorization: Bearer KEY' on /v1, /v2, /inference, /cohere "
                        "(default: $VLLM_API_KEY); the header is passed on to the instances")


def add_tracing_args(g, with_endpoint: bool = True) -> None:
    """OpenTelemetry export of the router's spans (off by default)."""
    from vllm_disagg.observe.tracing import DEFAULT_SAMPLE_RATIO

    if with_endpoint:
        g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export request traces over OTLP (gRPC, or http/protobuf with "
                            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); give the instances vLLM's flag of the same name")
    g.add_argument("--trace-sample-ratio", type=float, default=DEFAULT_SAMPLE_RATIO,
                   help="share of requests traced (an incoming traceparent's own decision is kept)")


def api_keys(args: argparse.Namespace) -> list[str]:
    return [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")]) if k]


def add_failover_args(g) -> None:
    """Replay and admission waits; `vllm-disagg up` adds the same to its own parser."""
    g.add_argument("--replay-attempts", type=int, default=3,
                   help="re-sends of a request whose instance failed; a stream goes on from the tokens sent (0: off)")
    g.add_argument("--replay-wait-s", type=float, default=300.0,
                   help="longest wait for a healthy instance (e.g. a restart) before a replay")
    g.add_argument("--admission-wait-s", type=float, default=120.0,
                   help="longest wait of a new request for a healthy instance (e.g. a restart) before 503 (0: at once)")
    g.add_argument("--max-waiting", type=int, default=256,
                   help="new requests that may wait for admission at once; past it 503 with Retry-After")
    g.add_argument("--stall-timeout-s", type=float, default=10.0,
                   help="cut an instance whose requests make no progress this long (stuck step, SIGSTOP, "
                        "partition) and replay them elsewhere")
    g.add_argument("--stall-factor", type=_stall_factor, default=5.0,
                   help="adaptive hang detection: cut an instance after this many times the step time its "
                        "/live expects (within --stall-min-s and --stall-timeout-s); 0 or off turns it off "
                        "(the fixed --stall-timeout-s only)")
    g.add_argument("--stall-min-s", type=float, default=2.0, help="shortest adaptive stall limit")
    g.add_argument("--stall-release-s", type=float, default=0.5,
                   help="adaptive detection: past this without progress, move an instance's requests that "
                        "showed the client nothing to an instance that steps (it is not cut)")


def _stall_factor(text: str) -> float | None:
    """`--stall-factor`: 0 (or "off") turns adaptive detection off."""
    if text.strip().lower() in ("off", "none"):
        return None
    value = float(text)
    if value == 0:
        return None
    if value <= 1:
        raise argparse.ArgumentTypeError(f"--stall-factor must be above 1 (or 0 for off), got {text}")
    return value


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        prefill_urls=args.prefill, prefill_kv=args.prefill_kv, decode_urls=args.decode,
        mixed_urls=args.mixed, pd_protocol=getattr(args, "pd_protocol", "push"), push_timeout_s=args.push_timeout_s, read_timeout_s=args.read_timeout_s,
        health_interval_s=args.health_interval_s, replay_attempts=args.replay_attempts,
        replay_wait_s=args.replay_wait_s, admission_wait_s=args.admission_wait_s,
        max_waiting=args.max_waiting, stall_timeout_s=args.stall_timeout_s, stall_factor=args.stall_factor,
        stall_min_s=args.stall_min_s, stall_release_s=args.stall_release_s, api_keys=api_keys(args),
        dynamic_membership=getattr(args, "discovery", "static") != "static",
    )


def add_queue_seconds_args(g) -> None:
    """The mixed pool's default trigger; the planner's `splitwise` simulator takes the same two flags."""
    from vllm_disagg.router.policy import SchedulerConfig

    g.add_argument("--prefill-queue-s", type=float, default=SchedulerConfig.prefill_queue_s,
                   help="P's prompt queue, in seconds of its measured prompt rate, above which D prefills "
                        "the prompt (mixed pool; 0 = off)")
    g.add_argument("--colocate-queue-s", type=float, default=SchedulerConfig.colocate_queue_s,
                   help="P's prompt queue in seconds above which P also decodes the request (0 = off)")


def queue_seconds_from_args(args: argparse.Namespace) -> dict[str, float | None]:
    """`add_queue_seconds_args`' flags as SchedulerConfig fields (0 = off = None)."""
    return {"prefill_queue_s": args.prefill_queue_s or None, "colocate_queue_s": args.colocate_queue_s or None}


def add_mixed_pool_args(g) -> None:
    """When Splitwise's mixed pool opens (router README, "policy.py"): `router`, `up` and Ray's `up` alike."""
    add_queue_seconds_args(g)
    g.add_argument("--prefill-queue-threshold", type=int, default=None,
                   help="also: pending prefill tokens above which prompts overflow to the mixed pool (default: off)")
    g.add_argument("--decode-queue-threshold", type=int, default=None,
                   help="pending decode tokens above which requests overflow to the mixed pool (default: off)")


def scheduler_config_from_args(args: argparse.Namespace):
    from vllm_disagg.router.policy import SchedulerConfig

    return SchedulerConfig(prefill_queue_threshold=args.prefill_queue_threshold,
                           decode_queue_threshold=args.decode_queue_threshold, **queue_seconds_from_args(args))


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "router", help="OpenAI-compatible Splitwise router in front of P/D pools",
        description=__doc__.splitlines()[0], allow_abbrev=False,
    )
    add_router_args(parser)
    from vllm_disagg.router.discovery import add_discovery_args

    add_discovery_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--reuse-port", action="store_true",
                        help="SO_REUSEPORT: several routers on one address share the connections, so "
                             "losing one costs only the streams it carried")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="json: one object per line with request_id and trace_id (text appends them)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from vllm_disagg.observe import logs, tracing
    from vllm_disagg.router.server import run_router

    logs.configure(args.log_format, service="vllm-disagg-router")
    try:
        config = config_from_args(args)
        tracing.configure("vllm-disagg-router", args.otlp_traces_endpoint, args.trace_sample_ratio)
    except ValidationError as err:
        msgs = "; ".join(e["msg"] for e in err.errors())
        raise SystemExit(f"vllm-disagg router: {msgs}") from None
    except ValueError as err:  # a bad sample ratio or OTLP protocol
        raise SystemExit(f"vllm-disagg router: {err}") from None
    try:
        return run_router(config, args.host, args.port, scheduler_config_from_args(args), args)
    finally:
        tracing.shutdown()
