# SPDX-License-Identifier: Apache-2.0
"""Chaos soak (issue 18): random faults in every role under load; nothing lost, hung, wrong or leaked.

    python benchmarks/chaos.py                        # the 10-minute soak: 1P+1D(model worker)+2 attention
    python benchmarks/chaos.py --quick                # ~2 min: the CI run (1P+1D, seven faults of seven kinds)
    python benchmarks/chaos.py --fuzz-only            # 10,000 fuzzed frames per port kind, in process
    python benchmarks/chaos.py --record-references    # plain vLLM's greedy answers -> benchmarks/data/
    python benchmarks/chaos.py --backend ray --attention 0   # on Ray, in a loopback-only netns (root)

Topology: `vllm-disagg up --prefill 1 --decode 1 [--attention 2]` (P is the mixed fallback: with D down
it serves whole requests), dead instances restarted, and two routers of it on one port (SO_REUSEPORT).
Load: a window of the Azure conversation trace (benchmarks/data/CHAOS_TRACE.md) through the routers
with the `openai` client: streamed and not, completions and chat, some clients leaving mid-stream.
Every 10-20 s one fault (vllm_disagg/testing/chaos/faults.py). Greedy tokens are checked against
plain vLLM's float32 answers recorded in benchmarks/data/chaos_references.json. At the end: leak
checks on every instance and attention server. Output: JSON (issue 18's keys) + a timeline PNG.
With --backend ray the same campaign runs on `up --backend ray` (testing/chaos/ray_deployment.py):
the script re-runs itself inside a fresh loopback-only network namespace with a one-node Ray cluster,
its routers find the instances through GCS, and half the kills hit the Ray actor instead of its server.
Run it under the heavy lock on a quiet box; the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_disagg.testing.chaos.campaign import (  # noqa: E402
    QUICK_STALL_TIMEOUT_S,
    CampaignConfig,
    quick_config,
    run_campaign,
)
from vllm_disagg.testing.chaos.deployment import Deployment  # noqa: E402
from vllm_disagg.testing.chaos.leaks import left_after_stop  # noqa: E402
from vllm_disagg.testing.chaos.ray_deployment import RayDeployment  # noqa: E402
from vllm_disagg.testing.chaos.workload import (  # noqa: E402
    REFERENCES,
    References,
    chaos_model,
    prompts_from_trace,
)

NUM_PROMPTS = 120
MAX_PROMPT_TOKENS = 384
MAX_OUTPUT_TOKENS = 32


def record_references(workdir: Path, out: Path) -> None:
    """Plain `vllm serve` (no plugin), greedy float32: each prompt as completions and as chat."""
    import subprocess

    from openai import OpenAI
    from transformers import AutoTokenizer

    from vllm_disagg.launch.local import free_ports
    from vllm_disagg.testing.chaos.deployment import ENGINE_ARGS

    path, fingerprint = chaos_model(workdir)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = []
    for ids, max_tokens in prompts_from_trace(NUM_PROMPTS, MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS, tok.vocab_size):
        prompts.append({"prompt_ids": ids, "chat_text": tok.decode(ids), "max_tokens": max_tokens})
    port = free_ports(1)[0]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1"}
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", path, "--port", str(port), "--served-model-name",
           "ref", *ENGINE_ARGS]
    with open(workdir / "plain.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        from vllm_disagg.testing.chaos.deployment import wait_http

        wait_http(f"http://127.0.0.1:{port}/health", 600)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=300)
        extra = {"ignore_eos": True, "return_token_ids": True}
        outputs = {}
        for i, p in enumerate(prompts):
            c = client.completions.create(model="ref", prompt=p["prompt_ids"], max_tokens=p["max_tokens"],
                                          temperature=0, extra_body=extra)
            outputs[f"{i}/completions"] = list(c.choices[0].token_ids)
            c = client.chat.completions.create(model="ref", messages=[{"role": "user", "content": p["chat_text"]}],
                                               max_tokens=p["max_tokens"], temperature=0, extra_body=extra)
            outputs[f"{i}/chat"] = list(c.choices[0].token_ids)
    finally:
        os.killpg(proc.pid, 9)
    References({**fingerprint, "engine_args": ENGINE_ARGS, "recorded_with": "plain vllm serve (no plugin)"},
               prompts, outputs).save(out)
    print(f"recorded {len(outputs)} references -> {out}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, height_ratios=[3, 1])
    colors = {"kill": "red", "stop": "orange", "stop_engine": "gold", "slow": "purple", "garbage_frames": "grey",
              "bad_http": "brown", "router_restart": "blue"}
    for f in result["faults"]:
        for a in (ax, ax2):
            a.axvspan(f["t_start_s"], max(f["t_end_s"], f["t_start_s"] + 0.5), color=colors.get(f["kind"], "k"),
                      alpha=0.2)
        ax.text(f["t_start_s"], 0.98, f"{f['kind']} {f['target'].split(',')[0]}", rotation=90, fontsize=6,
                va="top", transform=ax.get_xaxis_transform())
    outs = result["outcomes"]
    style = {"ok": ("g", "o"), "left": ("c", "."), "wrong": ("m", "x"), "lost": ("r", "X")}
    for kind, (c, m) in style.items():
        pts = [(o["t_sent_s"], o["ttft_s"] or 0) for o in outs if o["outcome"] == kind]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=10, c=c, marker=m, label=f"{kind} ({len(pts)})")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"chaos: {result['num_faults']} faults, lost {result['requests_lost']}, wrong "
                 f"{result['requests_wrong']}, max stall {result['max_stall_s']} s, "
                 f"leaks {result['kv_blocks_leaked']} KV / {result['shm_segments_leaked']} shm")
    ax.legend(loc="upper right", fontsize=7)
    stalls = [(o["t_sent_s"], o["max_gap_s"]) for o in outs if o["stream"]]
    if stalls:
        ax2.scatter(*zip(*stalls, strict=True), s=6, c="k")
    retries = [o["t_sent_s"] for o in outs if o["num_attempts"] > 1]
    ax2.scatter(retries, [0] * len(retries), s=12, c="r", marker="|", label="client retried")
    ax2.set_ylabel("longest gap (s)")
    ax2.set_xlabel("time since load start (s)")
    ax2.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fuzz_deployment(dep: Deployment, frames: int) -> dict:
    """Pre-auth fuzzing of every binary port of the running deployment (strangers only: a token
    holder's valid-looking writes into live KV are its right, see testing/fuzz.py)."""
    from vllm_disagg.testing.fuzz import FuzzTarget, fuzz_port

    out = {}
    for name, address in dep.binary_ports():
        inst = next((i for i in dep.instances() if name.startswith(i["name"])), None)
        # the probe authenticates as the port's own service: KV receivers (a decode's, an attention
        # server's kv_address) serve 'kv', side channels and attention listeners 'msg'
        service = b"kv" if name.endswith("kv_address") or (inst or {}).get("role") == "decode" else b"msg"
        target = FuzzTarget(name, address, service, dep.token, pid=inst["pid"] if inst else None)
        out[name] = fuzz_port(target, frames, post_auth=False, check_every=max(500, frames // 20)).as_dict()
    return out


def fuzz_in_process(frames: int) -> dict:
    """Authenticated (token-holder) fuzzing of each server kind, in this process: tests/unit/test_fuzz_ports.py
    at `frames` per port."""
    import subprocess

    env = {**os.environ, "VD_FUZZ_FRAMES": str(frames)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           str(REPO / "tests/unit/test_fuzz_ports.py")], env=env, capture_output=True, text=True,
                          timeout=3600)
    results = [ast.literal_eval(line[line.index("{'name'"):])  # pytest may put its "." before the dict
               for line in proc.stdout.splitlines() if "{'name'" in line]
    return {"passed": proc.returncode == 0, "ports": {r["name"]: r for r in results}}


def rereport(path: Path) -> int:
    """A finished run's TTFT split, slow requests and ratios again, from its stored outcomes and faults
    (after a change to how they are classified); the note says so in the file."""
    from vllm_disagg.testing.chaos.campaign import explain_slow
    from vllm_disagg.testing.chaos.cuts import ttft_split

    result = json.loads(path.read_text())
    before = result.get("p99_ttft_during_faults / p99_ttft_quiet")
    ttft_split(result)
    topology = result.get("topology", {})
    explain_slow(result, [f"prefill{i}" for i in range(topology.get("prefill", 1))]
                 + [f"decode{i}" for i in range(topology.get("decode", 1))])
    result["rereport_note"] = (f"TTFT keys recomputed offline by a request's whole life overlapping a fault "
                               f"(cuts.ttft_split); by send time alone the ratio was {before}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, path.with_suffix(".png"))
    print(json.dumps({k: result.get(k) for k in ("p99_ttft_quiet_s", "num_quiet_requests",
                                                 "p99_ttft_during_faults / p99_ttft_quiet",
                                                 "p99_ttft_during_faults_with_a_serving_instance / p99_ttft_quiet")}))
    return 0


NETNS_ENV = "VLLM_DISAGG_CHAOS_NETNS"
"""Set (to the namespace's name) in the copy of this script that runs inside the netns."""


def in_netns(argv: list[str]) -> int:
    """Run this script again inside a fresh loopback-only network namespace; remove it after."""
    import subprocess

    from vllm_disagg.testing.netns import Netns, prereqs

    if reason := prereqs():
        raise SystemExit(f"chaos.py --backend ray: {reason}")
    ns = Netns()
    try:
        env = {**os.environ, NETNS_ENV: ns.name}
        return subprocess.run(ns.argv(sys.executable, str(Path(__file__).resolve()), *argv), env=env).returncode
    finally:
        ns.destroy()


def _router_stall(args: argparse.Namespace, stall_timeout_s: float) -> dict:
    """The stall settings the routers ran with: a flag left out is the router's default (0: off)."""
    from vllm_disagg.router.config import RouterConfig
    fields = RouterConfig.model_fields
    factor = fields["stall_factor"].default if args.stall_factor is None else (args.stall_factor or None)
    return {"stall_timeout_s": stall_timeout_s, "stall_factor": factor,
            "stall_min_s": fields["stall_min_s"].default if args.stall_min_s is None else args.stall_min_s,
            "stall_release_s": fields["stall_release_s"].default if args.stall_release_s is None
            else args.stall_release_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI size: 1P+1D, seven faults of seven kinds")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--backend", choices=("local", "ray"), default="local",
                    help="ray: up --backend ray on a one-node Ray cluster, inside a loopback-only netns")
    ap.add_argument("--attention", type=int, default=2, help="attention servers behind the decode model worker")
    ap.add_argument("--prefill", type=int, default=1, help="prefill instances (2: a fault leaves one serving)")
    ap.add_argument("--decode", type=int, default=1, help="decode instances (2: a fault leaves one serving)")
    ap.add_argument("--rps", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-timeout-s", type=float, default=10.0)
    ap.add_argument("--stall-factor", type=float, default=None,
                    help="the routers' adaptive hang detection (router --stall-factor); "
                         "default: the router's (5); 0 turns it off")
    ap.add_argument("--stall-min-s", type=float, default=None, help="the adaptive limit's floor (router --stall-min-s)")
    ap.add_argument("--stall-release-s", type=float, default=None,
                    help="the soft limit's floor, past which not-started requests move (router --stall-release-s)")
    ap.add_argument("--fuzz-frames", type=int, default=10000,
                    help="per port, token holder's frames of every type (in process); 0 skips the fuzz phases")
    ap.add_argument("--deployment-fuzz-frames", type=int, default=2000,
                    help="per port of the running deployment, strangers' frames (each a new connection)")
    ap.add_argument("--plan", default=None,
                    help="a fixed fault plan, KIND:ROLE,... in order (e.g. slow_link:decode,kill:prefill)")
    ap.add_argument("--push-timeout-s", type=float, default=None, help="up --push-timeout-s (default: the plugin's)")
    ap.add_argument("--recompute-slow-pushes", choices=("on", "off"), default="on",
                    help="the instances' --disagg-recompute-slow-pushes (off: a push on a slow link waits to land)")
    ap.add_argument("--fuzz-only", action="store_true")
    ap.add_argument("--record-references", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rereport", default=None, metavar="JSON",
                    help="recompute a finished run's TTFT keys from its stored outcomes and faults, in place")
    args = ap.parse_args()
    if args.backend == "ray" and not os.environ.get(NETNS_ENV):
        return in_netns(sys.argv[1:])
    if args.rereport:
        return rereport(Path(args.rereport))
    workdir = Path(tempfile.mkdtemp(prefix="vd-chaos-"))
    if args.record_references:
        record_references(workdir, REFERENCES)
        return 0
    refs = References.load()
    path, fingerprint = chaos_model(workdir)
    if fingerprint["sha256"] != refs.model["sha256"]:
        raise SystemExit("the tiny model differs from the one the references were recorded with "
                         "(torch or tokenizer changed?): run --record-references")
    quick = args.quick
    cfg = quick_config(args.seed) if quick else CampaignConfig(duration_s=args.duration_s, rps=args.rps,
                                                               seed=args.seed, stop_s=(5.0, 30.0))
    if args.plan:
        cfg.plan = tuple(tuple(item.split(":", 1)) if ":" in item else (item, "") for item in args.plan.split(","))
    stall_timeout_s = QUICK_STALL_TIMEOUT_S if quick else args.stall_timeout_s
    name = ("chaos_quick" if quick else "chaos") + ("_ray" if args.backend == "ray" else "")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"{name}.json")
    t_start = time.time()
    result: dict = {"benchmark": "chaos", "quick": quick, "backend": args.backend, "loadavg_start": os.getloadavg(),
                    "topology": {"prefill": args.prefill, "decode": args.decode, "attention": 0 if quick else args.attention},
                    "router_stall": _router_stall(args, stall_timeout_s),
                    "recompute_slow_pushes": args.recompute_slow_pushes == "on"}
    if args.fuzz_frames and not quick:
        result["fuzz_in_process"] = fuzz_in_process(args.fuzz_frames)
    if args.fuzz_only:
        print(json.dumps(result, indent=1))
        return 0
    num_attention = 0 if quick else args.attention
    ray_backend = args.backend == "ray"
    kind = RayDeployment if ray_backend else Deployment
    dep = kind(workdir, path, num_attention=num_attention, num_prefill=args.prefill, num_decode=args.decode,
               stall_timeout_s=stall_timeout_s, stall_factor=args.stall_factor, stall_min_s=args.stall_min_s,
               stall_release_s=args.stall_release_s,
               slow_link=not ray_backend,  # slow_link, corrupt_link: P -> D or P -> each attention server
               kv_verify=True,  # corrupt_link's flip must be caught; Lamina's pushes are verified too
               push_timeout_s=args.push_timeout_s, recompute_slow_pushes=args.recompute_slow_pushes == "on")
    try:
        dep.start()
        result.update(run_campaign(dep, refs, cfg))
        if args.fuzz_frames and not quick:
            try:  # the campaign's figures are written whatever happens here
                result["fuzz_deployment"] = fuzz_deployment(dep, args.deployment_fuzz_frames)
            except Exception as err:  # noqa: BLE001 (reported in the JSON)
                result["fuzz_deployment_error"] = f"{type(err).__name__}: {err}"
    finally:
        result["leftover_process_groups"] = dep.stop()
    result["shm_left_after_stop"] = left_after_stop(dep.shm_at_start)
    result["shm_segments_leaked"] = result.get("shm_segments_leaked", 0) + len(result["shm_left_after_stop"])
    fuzz = [*result.get("fuzz_deployment", {}).values(), *result.get("fuzz_in_process", {}).get("ports", {}).values()]
    result["server_crashes_from_bad_input"] = sum(f["server_crashes_from_bad_input"] for f in fuzz)
    result["min_fuzzed_frames_per_port"] = min(
        (f["num_frames"] for f in result.get("fuzz_in_process", {}).get("ports", {}).values()), default=0)
    result["wall_s"] = round(time.time() - t_start, 1)
    result["loadavg_end"] = os.getloadavg()
    result["workdir"] = str(workdir)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    keys = ("requests_planned", "requests_total", "load_complete", "requests_lost", "requests_wrong", "kv_blocks_leaked", "shm_segments_leaked",
            "max_stall_s", "server_crashes_from_bad_input", "p99_ttft_during_faults / p99_ttft_quiet",
            "p99_ttft_during_faults_with_a_serving_instance / p99_ttft_quiet", "num_faults")
    slow = result.get("slow_requests", [])
    print(json.dumps({**{k: result.get(k) for k in keys}, "router_cuts": len(result.get("router_cuts", [])),
                      "router_suspects": len(result.get("router_suspects", [])),
                      "cuts_outside_faults": result.get("cuts_outside_faults"), "num_slow_requests": len(slow),
                      "slow_with_no_serving_instance": sum(s["no_serving_instance"] for s in slow)}, indent=1))
    if not result.get("load_complete", True):
        print(f"chaos: the load ended early ({result['requests_total']} of {result['requests_planned']} requests "
              f"sent; sender errors: {result['sender_errors']}): this run's figures cover part of it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
