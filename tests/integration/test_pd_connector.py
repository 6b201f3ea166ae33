# SPDX-License-Identifier: Apache-2.0
"""Real prefill and decode vLLM engines in separate processes, pushing KV over the tcp transport.

Each engine runs in its own process (`pd_engine_child.py`, in-process EngineCore, tiny float32
model, block_size 32, no prefix caching). The test sends the same prompts to P (max_tokens=1,
do_remote_decode) and D (do_remote_prefill) at the same time with shared transfer ids, exactly as
the router does (.coord/pd_protocol.md), and compares D's greedy tokens with a plain engine's.

With one side on the NanoFlow worker (2 nano-batches, `nanoflow_pd_child.py`), vLLM's per-layer save
hook fires once per nano-batch: the prefill side must push a layer only once *every* nano-batch has
written it (a request may even straddle two nano-batches: 1100-token prompts in 2048-token steps).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from vllm_disagg.testing import TEST_ENV, token_prompts

pytestmark = pytest.mark.slow

CHILD = str(Path(__file__).with_name("pd_engine_child.py"))
NANO_CHILD = str(Path(__file__).with_name("nanoflow_pd_child.py"))
NUM_REQS, PROMPT_LEN, MAX_TOKENS = 16, 1100, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """A child process hosting one engine; JSON lines on stdin/stdout, logs to a file."""

    def __init__(self, role: str, model_dir: str, log_dir: Path, cpu: str, child: str = CHILD, **opts):
        env = {**os.environ, **TEST_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_CPU_OMP_THREADS_BIND": cpu}
        self.log_path = log_dir / f"{role}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, child, role, model_dir, json.dumps(opts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self._read(timeout=180)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            start = line.find('{"')  # stray prints (no newline) may precede our JSON line
            if start >= 0:
                self._lines.put(json.loads(line[start:]))
        self._lines.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            msg = None
        if msg is None:
            raise RuntimeError(f"engine child gave no answer; log tail:\n{self.log_text()[-3000:]}")
        return msg

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def generate(self, prompts, params, max_tokens: int) -> None:
        self.send({"cmd": "generate", "prompts": prompts, "params": params, "max_tokens": max_tokens})

    def result(self, timeout: float = 300) -> dict:
        return self._read(timeout)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _pd_params(n: int, p_port: int, timeout_s: float = 30.0) -> tuple[list, list]:
    tids = [uuid.uuid4().hex for _ in range(n)]
    p_params = [{"do_remote_decode": True, "transfer_id": t} for t in tids]
    d_params = [{"do_remote_prefill": True, "transfer_id": t, "remote_host": "127.0.0.1",
                 "remote_port": p_port, "push_timeout_s": timeout_s} for t in tids]
    return p_params, d_params


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # lengths 1100..1115: many blocks, a partial last block, different per request
    return [p["prompt_token_ids"][: PROMPT_LEN + i] for i, p in enumerate(token_prompts(NUM_REQS, PROMPT_LEN + 16))]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pd-logs")


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, prompts, log_dir) -> list[list[int]]:
    plain = Engine("plain", tiny_model_dir, log_dir, "0")
    try:
        plain.generate(prompts, [None] * len(prompts), MAX_TOKENS)
        return plain.result()["outputs"]
    finally:
        plain.close()


@pytest.fixture(scope="module")
def decode(tiny_model_dir, log_dir):
    eng = Engine("decode", tiny_model_dir, log_dir, "1", kv_port=_free_port(), policy="recompute")
    yield eng
    eng.close()


def _start_prefill(model_dir: str, log_dir: Path, **opts) -> tuple[Engine, int]:
    port = _free_port()
    return Engine("prefill", model_dir, log_dir, "0", kv_port=port, **opts), port


def _run_pd(prefill: Engine, decode: Engine, port: int, prompts, timeout_s: float = 30.0):
    p_params, d_params = _pd_params(len(prompts), port, timeout_s)
    decode.generate(prompts, d_params, MAX_TOKENS)
    prefill.generate(prompts, p_params, 1)
    return prefill, decode.result()  # P's answer stays queued for prefill.result()


@pytest.mark.parametrize("mode,threshold", [("layerwise", 256), ("serialized", 4096)])
def test_decode_output_equals_plain_vllm_and_no_block_leaks(
    mode, threshold, tiny_model_dir, prompts, baseline, decode, log_dir
):
    _check_pd_run(mode, threshold, tiny_model_dir, prompts, baseline, decode, log_dir, "tcp")


def test_the_shm_transport_gives_the_same_tokens_with_layerwise_pushes(tiny_model_dir, prompts, baseline, log_dir):
    decode = Engine("decode", tiny_model_dir, log_dir, "1", kv_port=_free_port(), transport="shm")
    try:
        _check_pd_run("layerwise", 256, tiny_model_dir, prompts, baseline, decode, log_dir, "shm")
    finally:
        decode.close()


def _check_pd_run(mode, threshold, tiny_model_dir, prompts, baseline, decode, log_dir, transport, **prefill_opts):
    prefill, port = _start_prefill(tiny_model_dir, log_dir, threshold=threshold, transport=transport, **prefill_opts)
    seen = len(decode.log_text())  # the module's decode engine logged the earlier tests' recomputes
    try:
        _, d_out = _run_pd(prefill, decode, port, prompts)
        p_out = prefill.result()
        assert d_out["outputs"] == baseline, f"{mode}: decode tokens differ from plain vLLM"
        assert p_out["free_blocks"] == prefill.ready["free_blocks"], "prefill leaked KV blocks"
        assert d_out["free_blocks"] == decode.ready["free_blocks"], "decode leaked KV blocks"
        pushes = p_out["timeline"]
        assert len(pushes) == NUM_REQS and all(p["layerwise"] == (mode == "layerwise") for p in pushes)
        assert "recomputes the prompt" not in decode.log_text()[seen:], "a push failed; see the decode log"
        assert "abandoned" not in prefill.log_text()
        if mode == "serialized":
            assert all(p["num_writes"] == 1 for p in pushes)
        else:
            # Splitwise's point: some layer writes start before that request's prefill is over.
            early = [p for p in pushes if p["t_first_issue"] < p["t_prefill_done"]]
            assert early, f"no layer-wise push started before prefill finished: {pushes[:3]}"
        exposed = sorted(p["t_done"] - p["t_prefill_done"] for p in pushes)
        frac = sorted((p["t_done"] - p["t_prefill_done"]) / (p["t_prefill_done"] - p["t_prefill_start"]) for p in pushes)
        print(f"\n{mode}/{transport}: {len([p for p in pushes if p['t_first_issue'] < p['t_prefill_done']])}/{len(pushes)} "
              f"pushes started before their prefill ended; exposed ms median "
              f"{1e3 * exposed[len(exposed) // 2]:.2f} max {1e3 * exposed[-1]:.2f}; exposed/prefill median "
              f"{frac[len(frac) // 2]:.3f} (prefill time includes queueing behind the batch)")
        return p_out, d_out
    finally:
        prefill.close()


def test_killing_prefill_mid_transfer_falls_back_to_local_prefill(
    tiny_model_dir, prompts, baseline, decode, log_dir
):
    prefill, port = _start_prefill(tiny_model_dir, log_dir, write_delay_s=0.25)
    try:
        p_params, d_params = _pd_params(len(prompts), port, timeout_s=20.0)
        decode.generate(prompts, d_params, MAX_TOKENS)
        prefill.generate(prompts, p_params, 1)
        time.sleep(4.0)  # about a dozen of the 32 slowed writes have landed by now
        prefill.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        d_out = decode.result(timeout=120)
        assert d_out["outputs"] == baseline
        assert d_out["free_blocks"] == decode.ready["free_blocks"], "decode leaked KV blocks"
        assert time.monotonic() - t0 < 60
        log = decode.log_text()
        assert "recomputes the prompt" in log
    finally:
        prefill.close()


def test_a_slow_link_past_the_push_timeout_falls_back_and_its_late_bytes_never_land(
    tiny_model_dir, prompts, baseline, log_dir
):
    """The KV link is throttled (D advertises a proxy: `kv.advertise_address`), so every push outlasts
    D's push timeout and P cannot answer the CANCEL in time. D recomputes the prompts into the blocks
    it gave up on while the bytes keep arriving; the receiver's fence must drop them (tokens exact)."""
    from vllm_disagg.testing.throttle import ThrottledProxy

    d_port = _free_port()
    proxy = ThrottledProxy(f"127.0.0.1:{d_port}", rate_bytes_per_s=512 << 10)  # 17 MiB on 2 streams: ~17 s
    decode = Engine("decode", tiny_model_dir, log_dir, "1", kv_port=d_port, policy="recompute",
                    advertise=proxy.address)
    prefill, port = _start_prefill(tiny_model_dir, log_dir)
    try:
        _, d_out = _run_pd(prefill, decode, port, prompts, timeout_s=2.0)
        forwarded_at_result = proxy.num_forwarded
        assert d_out["outputs"] == baseline, "decode tokens differ from plain vLLM: late KV bytes landed?"
        assert "recomputes the prompt" in decode.log_text()  # the pushes did fail over
        time.sleep(1.0)
        assert proxy.num_forwarded > forwarded_at_result  # and bytes were still arriving afterwards
    finally:
        proxy.close()  # P's stuck writes fail now; it frees their blocks
        prefill.close()
        decode.close()


def test_a_byte_flipped_on_the_link_is_caught_by_verification_and_that_prompt_recomputed(
    tiny_model_dir, prompts, baseline, log_dir
):
    """A proxy on the KV link flips one byte 1 MiB in: it lands in D's blocks, and no frame check sees a
    payload byte. With `kv.verify_checksums` D compares P's per-layer CRC32s once a push landed, finds
    that one push, and recomputes its prompt; every other push is verified and used (tokens exact)."""
    from vllm_disagg.testing.throttle import ThrottledProxy

    d_port = _free_port()
    proxy = ThrottledProxy(f"127.0.0.1:{d_port}", rate_bytes_per_s=None, corrupt_at=1 << 20)
    decode = Engine("decode", tiny_model_dir, log_dir, "1", kv_port=d_port, policy="recompute",
                    advertise=proxy.address, verify=True)
    prefill, port = _start_prefill(tiny_model_dir, log_dir)
    try:
        _, d_out = _run_pd(prefill, decode, port, prompts)
        assert proxy.num_corrupted == 1
        assert d_out["outputs"] == baseline, "decode tokens differ from plain vLLM: damaged KV used?"
        log = decode.log_text()
        assert log.count("KV checksum mismatch") == 1 and log.count("recomputes the prompt") == 1
        assert d_out["free_blocks"] == decode.ready["free_blocks"]
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def test_handshake_mismatch_fails_fast_with_the_field_named(tiny_model_dir, prompts, decode, log_dir):
    """A bfloat16 P pushing to the module's float32 D (which keeps "recompute", needed for the dead-P
    fallback; patches/P4 still fails a mismatch fast)."""
    prefill, port = _start_prefill(tiny_model_dir, log_dir, dtype="bfloat16")
    seen = len(decode.log_text())
    try:
        t0 = time.monotonic()
        _, d_out = _run_pd(prefill, decode, port, prompts[:2], timeout_s=60.0)
        p_out = prefill.result(timeout=60)
        assert time.monotonic() - t0 < 30, "a handshake mismatch must not wait for the push timeout"
        assert d_out["finish_reasons"] == ["error", "error"]
        assert all(len(o) == 0 for o in d_out["outputs"]), "no tokens may come from mismatched KV"
        assert "handshake mismatch" in decode.log_text()[seen:] and "'dtype'" in decode.log_text()[seen:]
        assert "'dtype'" in prefill.log_text()
        assert p_out["free_blocks"] == prefill.ready["free_blocks"]
        assert d_out["free_blocks"] == decode.ready["free_blocks"]
    finally:
        prefill.close()


def _assert_nano_batched(out: dict, role: str) -> None:
    stats = out.get("nano_stats") or {}
    assert stats.get("pipeline_steps", 0) > 0 and not stats.get("fallback_steps"), (
        f"{role} did not run nano-batched steps: {stats}")


def test_nano_batched_decode_gives_plain_vllm_tokens_without_recompute(tiny_model_dir, prompts, baseline, log_dir):
    decode = Engine("decode", tiny_model_dir, log_dir, "1", child=NANO_CHILD, kv_port=_free_port(),
                    policy="recompute", nano_batches=2)
    try:
        _, d_out = _check_pd_run("layerwise", 256, tiny_model_dir, prompts, baseline, decode, log_dir, "tcp")
        _assert_nano_batched(d_out, "decode")
    finally:
        decode.close()


def test_nano_batched_prefill_pushes_a_layer_only_once_every_nano_batch_wrote_it(
        tiny_model_dir, prompts, baseline, decode, log_dir):
    # every later nano-batch's attention (its KV write) is delayed: a push of a layer after only the
    # first nano-batch wrote it would read stale KV for the tokens of the second one
    p_out, _ = _check_pd_run("layerwise", 256, tiny_model_dir, prompts, baseline, decode, log_dir, "tcp",
                             child=NANO_CHILD, nano_batches=2, late_nano_delay_s=0.2)
    _assert_nano_batched(p_out, "prefill")
    assert p_out["kv_writes_checked"] > 0
    assert p_out["kv_writes_stale"] == 0, "the prefill side pushed KV blocks before every nano-batch wrote them"
