# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg attn-server`: run one attention server in the foreground.

On start it prints one line `READY {json}` (the `/health` body: http and data addresses) and,
with `--ready-file`, writes the same JSON there, so launchers know where it listens. SIGTERM and
Ctrl-C stop it cleanly.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import threading


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("attn-server", help="run a Lamina attention server (owns a KV shard)",
                              description=__doc__.splitlines()[0])
    add_server_args(p)
    p.set_defaults(func=run)
    return p


def add_server_args(p: argparse.ArgumentParser, with_host_port: bool = True) -> None:
    """`with_host_port=False` leaves --host/--port to the caller (`vllm launch` has them already)."""
    p.add_argument("--transport", default="shm", choices=["shm", "tcp", "nixl"],
                   help="data path for the per-layer exchange (default: shm, same host)")
    if with_host_port:
        p.add_argument("--host", default="127.0.0.1", help="interface for HTTP and tcp (default 127.0.0.1)")
        p.add_argument("--http-port", type=int, default=0, help="port of /health and /metrics (0: pick one)")
    p.add_argument("--data-port", type=int, default=0,
                   help="fixed port of the tcp/nixl data listener, e.g. for k8s NetworkPolicies (0: pick one; "
                        "shm listens on a unix socket and ignores it)")
    p.add_argument("--kv-transport", default=None, choices=["tcp", "shm", "nixl"],
                   help="accept prefill KV pushes on this transport (the prefill instances' kv.transport; "
                        "default: none)")
    p.add_argument("--kv-port", type=int, default=0,
                   help="with --kv-transport tcp/nixl: fixed port of the prefill KV receiver, e.g. for k8s "
                        "NetworkPolicies (0: pick one; reported on /health as kv_address)")
    p.add_argument("--kv-advertise", default=None, metavar="HOST:PORT",
                   help="with --kv-transport tcp: the address prefill instances connect to for this server's KV "
                        "receiver, where it differs from where it listens (a proxy, a NAT, a Kubernetes Service); "
                        "/health reports it as kv_address and the listening one as kv_listen_address")
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="KV memory of this shard in GiB")
    p.add_argument("--kernel", default="cpu", choices=["cpu", "cuda", "torch", "none"],
                   help="attention kernel: vLLM's CPU kernel, or FlashAttention on a GPU (untested); 'torch': "
                        "plain torch SDPA on a CUDA device if present, else CPU (no vLLM needed); 'none' "
                        "answers without computing (benchmarks: the transport round trip alone)")
    p.add_argument("--spin-us", type=float, default=None,
                   help="shm: busy-poll this long for the next message before sleeping (default: the "
                        "transport's, 0 on <= 2 CPUs); worth it when the server has a core of its own")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of the kernel (default 1: one core per server; more threads on an "
                        "oversubscribed box cost far more in OpenMP waits than they gain)")
    p.add_argument("--retain-ttl-s", type=float, default=600.0,
                   help="keep the blocks a model worker registered for this long after a new one connects "
                        "with the same geometry (a restart), restorable by key; 0 disables (default 600)")
    p.add_argument("--retain-copy-gib", type=float, default=None,
                   help="memory for retained blocks the new session overwrites (copied aside first); past it "
                        "they are dropped (default: a quarter of --kv-cache-gib)")
    p.add_argument("--kv-ingest-ttl-s", type=float, default=120.0,
                   help="with --kv-transport: forget the landed-byte count of a push no decode worker collected "
                        "after this long (keep it above the prefill push timeout)")
    p.add_argument("--ready-file", default=None, help="write the READY json here once serving")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process is gone (launchers pass their pid: no orphaned servers)")
    if with_host_port:  # `vllm launch` has vLLM's own flag of that name
        p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export spans of sampled attention calls over OTLP (as vLLM's flag)")


def run(args: argparse.Namespace) -> int:
    from vllm_disagg.attention.server import DisaggAttentionServer
    from vllm_disagg.observe import tracing

    tracing.configure("vllm-disagg-attention", getattr(args, "otlp_traces_endpoint", None))
    try:
        server = DisaggAttentionServer(
            transport=args.transport, kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
            kernel=args.kernel, http_host=args.host, http_port=args.http_port, num_threads=args.threads,
            data_port=args.data_port, kv_transport=args.kv_transport, kv_port=args.kv_port,
            kv_advertise=args.kv_advertise, spin_us=args.spin_us,
            retain_ttl_s=args.retain_ttl_s, kv_ingest_ttl_s=args.kv_ingest_ttl_s,
            retain_copy_bytes=None if args.retain_copy_gib is None else int(args.retain_copy_gib * (1 << 30)),
        )
    except (ValueError, OSError) as err:
        print(f"vllm-disagg attn-server: {err}", file=sys.stderr)
        return 2
    info = server.start()
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            json.dump(info, f)
        import os

        os.replace(args.ready_file + ".tmp", args.ready_file)
    print("READY " + json.dumps(info), flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        if args.parent_pid and not _alive(args.parent_pid):
            break
    server.stop()
    tracing.shutdown()
    return 0


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()  # a crash in a native kernel (SIGILL, SIGSEGV) leaves its stack in the log
    parser = argparse.ArgumentParser(prog="python -m vllm_disagg.attention.cli")
    add_server_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
