# SPDX-License-Identifier: Apache-2.0
"""One cell of the model matrix: a tiny family (`families.py`) through one mechanism, its greedy
float32 tokens, and proof that the mechanism really ran.

Mechanisms: `plain` (stock vLLM), `pd_tcp` (1 prefill + 1 decode engine, layer-wise push over tcp,
child processes), `remote_head` / `remote_request` (Lamina: attention on 2 attention servers,
head- or request-wise), `nano2` (NanoFlow, 2 nano-batches). `tests/integration/test_model_matrix.py`
runs them on every family against `plain`; `benchmarks/model_matrix.py` runs every cell and writes
the result the README's compatibility table is made from (`compat_table`).
"""

from __future__ import annotations

import gc
import json
import os
import queue
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path

from vllm_disagg.testing.env import TEST_ENV
from vllm_disagg.testing.models import tiny_llm_kwargs, token_prompts

MECHANISMS = ("plain", "pd_tcp", "remote_head", "remote_request", "nano2")
MECHANISM_TITLES = {"plain": "plain vLLM", "pd_tcp": "1P+1D (tcp)", "remote_head": "remote attention, head-wise",
                    "remote_request": "remote attention, request-wise", "nano2": "2 nano-batches"}
# multi-block prompts (block 32) longer than the families' windows (48), one short, decoded together
PROMPTS = [p["prompt_token_ids"] for p in token_prompts(2, 100, seed=11) + token_prompts(1, 70, seed=12)
           + token_prompts(1, 20, seed=13)]
MAX_TOKENS = 8
NANOFLOW_WORKER = "vllm_disagg.nanoflow.worker.NanoFlowCPUWorker"
REMOTE_WORKER = "vllm_disagg.attention.worker.DisaggAttentionWorker"
PD_CHILD = Path(__file__).resolve().parents[2] / "tests" / "integration" / "pd_engine_child.py"


class CellRefused(RuntimeError):
    """The mechanism refused this family at start, with one line saying why."""


def generate(model_dir, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, probe=None, **over) -> list[list[int]]:
    """Greedy tokens of an in-process engine (float32, block 32, no prefix caching); `probe(llm)`
    runs before it shuts down (what the cell checks ran)."""
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(**tiny_llm_kwargs(model_dir, **over))
    except BaseException:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()  # else the next in-process engine inherits this one's groups (no EP group)
        raise
    try:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        if probe is not None:
            probe(llm)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def remote_kwargs(servers: list[str], partition: str) -> dict:
    return dict(worker_cls=REMOTE_WORKER, additional_config={"disagg": {"remote_attention": {
        "servers": servers, "partition": partition, "send_q_early": False, "transport": "shm"}}})


def nano_kwargs() -> dict:
    return dict(worker_cls=NANOFLOW_WORKER, additional_config={"disagg": {"nanoflow": {"num_nano_batches": 2}}})


def run_in_process(mechanism: str, model_dir, servers: list[str] | None = None) -> tuple[list[list[int]], dict]:
    """plain / remote_* / nano2: (tokens, evidence the mechanism ran). A refusal raises
    `CellRefused` with the engine's one-line reason."""
    evidence: dict = {}
    if mechanism == "plain":
        return generate(model_dir), evidence
    if mechanism.startswith("remote_"):
        before = [server_messages(s) for s in servers]
        try:
            tokens = generate(model_dir, **remote_kwargs(servers, mechanism.removeprefix("remote_")))
        except Exception as err:  # noqa: BLE001 (the refusal is somewhere in the chain)
            raise CellRefused(refusal_line(err)) from err
        evidence["attn_messages"] = sum(server_messages(s).get("ATTN", 0) - b.get("ATTN", 0)
                                        for s, b in zip(servers, before))
        return tokens, evidence
    if mechanism == "nano2":
        def probe(llm):
            stats = llm.llm_engine.collective_rpc("nanoflow_stats")[0]
            evidence["nano_steps"] = int(stats.get("nano_steps", stats.get("split_steps", 0)) or 0)
            evidence["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}

        try:
            return generate(model_dir, probe=probe, **nano_kwargs()), evidence
        except Exception as err:  # noqa: BLE001
            raise CellRefused(refusal_line(err)) from err
    raise ValueError(f"unknown in-process mechanism {mechanism!r}")


def remote_nano2(model_dir, servers: list[str]) -> tuple[list[list[int]], dict]:
    """Remote attention (one server, head-wise) with 2 nano-batches in flight: (tokens, nanoflow stats)."""
    kw = remote_kwargs(servers[:1], "head")
    kw["worker_cls"] = "vllm_disagg.nanoflow.remote.NanoFlowRemoteAttentionWorker"
    kw["additional_config"]["disagg"]["nanoflow"] = {"num_nano_batches": 2}
    evidence: dict = {}

    def probe(llm):
        stats = llm.llm_engine.collective_rpc("nanoflow_stats")[0]
        evidence["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}

    try:
        return generate(model_dir, probe=probe, **kw), evidence
    except Exception as err:  # noqa: BLE001
        raise CellRefused(refusal_line(err)) from err


def pd_remote(model_dir, log_dir: Path, partition: str = "request") -> tuple[list[list[int]], dict]:
    """`vllm-disagg up --prefill 1 --decode 1 --attention 2`: P pushes each prompt's KV onto the attention
    servers (every push verified end to end), D decodes on them; `model_dir` needs a tokenizer (the HTTP
    API). (tokens, evidence: bytes each server took in, checksum queries answered, KV errors)."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_disagg.testing.chaos.leaks import metrics
    from vllm_disagg.testing.up import running_up

    args = ["--prefill", "1", "--decode", "1", "--attention", "2", "--attention-partition", partition,
            "--layerwise-threshold", "16", "--model", str(model_dir), "--disagg-kv-verify", "on", "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "2048", "--block-size", "32", "--no-enable-prefix-caching",
            "--seed", "0"]
    with running_up(log_dir, *args) as up:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(up.state, p), PROMPTS))
        names = ("vllm:disagg_attention_kv_ingest_bytes_total", "vllm:disagg_attention_kv_checksum_queries_total")
        scraped = [metrics(i["url"], names) for i in up.state["instances"] if i["role"] == "attention"]
        evidence = {"ingest_bytes": [m[names[0]] for m in scraped], "checksum_queries": [m[names[1]] for m in scraped],
                    "kv_errors": [params["disagg_kv_error"] for _, params in got if params.get("disagg_kv_error")]}
    return [ids for ids, _ in got], evidence


def _complete(state: dict, prompt: list[int]) -> tuple[list[int], dict]:
    body = {"model": state["model"], "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{state['endpoint']}/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"}, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as resp:
        event = json.load(resp)
    return event["choices"][0]["token_ids"], event.get("kv_transfer_params") or {}


def refusal_line(err: BaseException) -> str:
    """The first line of the innermost exception that says something (vLLM wraps worker errors)."""
    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):
        text = str(e).strip()
        if text:
            return f"{type(e).__name__}: {text.splitlines()[0]}"
    return type(err).__name__


def server_messages(http: str) -> dict:
    """Messages an attention server handled so far, by type (its Prometheus /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    out: dict = {}
    for line in lines:
        if line.startswith("vllm:disagg_attention_messages_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


class EngineChild:
    """One engine in a child process (`tests/integration/pd_engine_child.py`, JSON lines)."""

    def __init__(self, role: str, model_dir, log_dir: Path, cpu: str, **opts):
        env = {**os.environ, **TEST_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_CPU_OMP_THREADS_BIND": cpu}
        self.log_path = Path(log_dir) / f"{role}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, str(PD_CHILD), role, str(model_dir), json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env, start_new_session=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self.read(timeout=240)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            start = line.find('{"')
            if start >= 0:
                self._lines.put(json.loads(line[start:]))
        self._lines.put(None)

    def read(self, timeout: float = 300) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            msg = None
        if msg is None:
            raise RuntimeError(f"engine child gave no answer; log tail:\n{self.log_text()[-3000:]}")
        return msg

    def generate(self, prompts, params, max_tokens: int) -> None:
        self.proc.stdin.write(json.dumps({"cmd": "generate", "prompts": prompts, "params": params,
                                          "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


def run_pd(model_dir, log_dir: Path, kv_port: int, prompts=PROMPTS, prefill_opts: dict | None = None,
           decode_opts: dict | None = None) -> tuple[list[list[int]], dict]:
    """1P+1D over tcp, layer-wise pushes for every prompt: (D's tokens, evidence the pushes ran).
    `*_opts`: more engine-child options (pd_engine_child.py), e.g. P's `mnbt` (prefill chunk tokens)."""
    (outputs,), evidence = run_pd_rounds(model_dir, log_dir, kv_port, [prompts], prefill_opts, decode_opts)
    return outputs, evidence


def run_pd_rounds(model_dir, log_dir: Path, kv_port: int, rounds: list[list], prefill_opts: dict | None = None,
                  decode_opts: dict | None = None) -> tuple[list[list[list[int]]], dict]:
    """`run_pd` over the same two engines, one batch of prompts after another (a later round can hit
    what an earlier one left in D's prefix cache): (D's tokens per round, evidence over all rounds)."""
    prefill = decode = None
    try:
        decode = EngineChild("decode", model_dir, log_dir, "1", kv_port=0, policy="recompute", **(decode_opts or {}))
        prefill = EngineChild("prefill", model_dir, log_dir, "0", kv_port=kv_port, threshold=16, **(prefill_opts or {}))
        outputs, pushes = [], []
        for prompts in rounds:
            transfer_ids = [uuid.uuid4().hex for _ in prompts]
            decode.generate(prompts, [{"do_remote_prefill": True, "transfer_id": t, "remote_host": "127.0.0.1",
                                       "remote_port": kv_port, "push_timeout_s": 60.0} for t in transfer_ids],
                            MAX_TOKENS)
            prefill.generate(prompts, [{"do_remote_decode": True, "transfer_id": t} for t in transfer_ids], 1)
            d_out, p_out = decode.read(), prefill.read()
            outputs.append(d_out["outputs"])
            pushes = p_out["timeline"]  # every push so far
        log = decode.log_text()
        evidence = {"pushes": len(pushes), "layerwise": sum(bool(p.get("layerwise")) for p in pushes),
                    "recomputed": "recomputes the prompt" in log, "checksum_mismatch": "checksum mismatch" in log,
                    "kv_cache_groups": [prefill.ready.get("kv_cache_groups"), decode.ready.get("kv_cache_groups")],
                    "bytes_pushed": sum(p.get("num_bytes", 0) for p in pushes), "handshake": prefill.ready.get("handshake")}
        return outputs, evidence
    except RuntimeError as err:
        raise CellRefused(refusal_line(err)) from err
    finally:
        for eng in (prefill, decode):
            if eng is not None:
                eng.close()


# ---- the README's compatibility table, made from benchmarks/results/model_matrix.json -----------
TABLE_START = "<!-- compat-table:start (generated by `make compat-table` from benchmarks/results/model_matrix.json) -->"
TABLE_END = "<!-- compat-table:end -->"


def compat_table(result: dict) -> str:
    """Markdown: one row per family, one column per mechanism, ✅ or the one-line refusal."""
    head = ["family", "covers", *(MECHANISM_TITLES[m] for m in MECHANISMS)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, info in result["families"].items():
        cells = []
        for mech in MECHANISMS:
            cell = result["cells"].get(family, {}).get(mech)
            if cell is None:
                cells.append("not run")
            elif cell["status"] == "ok":
                cells.append("✅")
            else:
                cells.append(f"{'refused' if cell['status'] == 'refused' else '❌ failed'}: "
                             f"{cell['reason'].replace('|', '/')}")
        covers = ", ".join(info["features"])
        mattered = result.get("window_mattered", {}).get(family)
        if mattered is not None:  # the same weights with full attention gave other tokens (or did not)
            covers += f" (window {info.get('sliding_window')}: {'changes' if mattered else 'does NOT change'} the tokens)"
        rows.append("| " + " | ".join([family, covers, *cells]) + " |")
    return "\n".join(rows)


def replace_table(readme: str, table: str) -> str:
    """`readme` with the text between the table markers replaced by `table`."""
    start, end = readme.index(TABLE_START), readme.index(TABLE_END)
    return readme[: start + len(TABLE_START)] + "\n" + table + "\n" + readme[end:]


def readme_table(readme: str) -> str:
    start, end = readme.index(TABLE_START), readme.index(TABLE_END)
    return readme[start + len(TABLE_START): end].strip("\n")


RESULT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "model_matrix.json"


def main(argv: list[str] | None = None) -> None:
    """`make compat-table`: rewrite the README's table from the committed matrix result."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_disagg.testing.matrix")
    ap.add_argument("--result", default=str(RESULT_PATH))
    ap.add_argument("--write-readme", metavar="README", help="replace the table between its markers")
    args = ap.parse_args(argv)
    table = compat_table(json.loads(Path(args.result).read_text()))
    if args.write_readme:
        readme = Path(args.write_readme)
        readme.write_text(replace_table(readme.read_text(), table))
    else:
        print(table)


if __name__ == "__main__":
    main()
