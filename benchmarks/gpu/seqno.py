# SPDX-License-Identifier: Apache-2.0
"""Step a: the csrc seqno-polling kernel, built with nvcc for the device, and its poll-to-observe time.

* build: `csrc/build.sh` for the device's own arch (sm_90 on an H100/H200), checked with cuobjdump.
* gpu_unit_tests: `tests/unit/transport/test_csrc_seqno_gpu.py` (a consumer queued behind the wait
  runs only after the word lands; a spin bound raises the timeout flag instead of hanging).
* stream_write / peer_process_write: a writer kernel stamps the GPU's %globaltimer and writes the
  word, from another stream of this process or from another process through CUDA IPC (the peer
  GPU / NIC stand-in); the probe kernel stamps when it saw it. Same clock: exact poll-to-observe.
* host_write: the CPU stores the word into pinned, mapped host memory; the probe answers through
  an ack word there. Host round trip (`rtt_us`), with rtt/2 as the one-way estimate (labelled).
  Baseline for the same round trip: CUDA's own stream memory ops (cuStreamWaitValue64 +
  cuStreamWriteValue64), what a user would otherwise write.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time

from common import REPO, Budget, StepResult, Unsupported, cuda_ready, run_pytest

CSRC = REPO / "csrc"
LIB = CSRC / "build" / "libvd_seqno.so"
ITERS = 200
CHECKS = ("build", "gpu_unit_tests", "stream_write", "peer_process_write", "host_write", "host_write_stream_memops")
MAX_SPINS = 1 << 22  # with backoff to 1 us: ~4 s before the timeout flag, never a hung stream


def run_step(device: str, budget: Budget) -> StepResult:
    result = StepResult("a", "csrc seqno kernel: nvcc build, poll-to-observe latency", device)
    why_not = cuda_ready() if device == "cuda" else "CPU twin: no GPU"
    nvcc = shutil.which("nvcc")
    if device != "cuda" or why_not:
        reason = why_not or "CPU twin"
        if nvcc:  # the build itself needs no GPU: check it compiles (as CI does)
            result.run("build", lambda: _build(check_only=True), budget, 60)
        else:
            result.skip("build", "nvcc not found")
        for name in CHECKS[1:]:
            result.skip(name, reason)
        return result
    if result.run("build", _build, budget, 40)["status"] != "ok":
        return result
    result.run("gpu_unit_tests", _gpu_unit_tests, budget, 40)
    lib = _load()
    result.run("stream_write", lambda: _stream_write(lib), budget, 20)
    result.run("peer_process_write", lambda: _peer_process_write(), budget, 30)
    result.run("host_write", lambda: _host_write(lib), budget, 20)
    result.run("host_write_stream_memops", _host_write_stream_memops, budget, 20)
    return result


def _build(check_only: bool = False) -> dict:
    arch = _device_arch() if not check_only else "90"
    env = dict(os.environ, CUDA_ARCHS=arch)
    t0 = time.monotonic()
    cmd = ["bash", str(CSRC / "build.sh")] + (["--check"] if check_only else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if out.returncode:
        raise RuntimeError(f"csrc/build.sh failed: {out.stderr[-2000:]}")
    info = {"arch": f"sm_{arch}", "build_s": round(time.monotonic() - t0, 2), "nvcc": _nvcc_version(),
            "compile_only": check_only}
    if not check_only and shutil.which("cuobjdump"):
        elf = subprocess.run(["cuobjdump", "--list-elf", str(LIB)], capture_output=True, text=True, timeout=60)
        info["elf"] = elf.stdout.split()
        if f"sm_{arch}" not in elf.stdout:
            raise RuntimeError(f"no sm_{arch} machine code in {LIB}: {elf.stdout[-500:]}")
    return info


def _device_arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def _nvcc_version() -> str:
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else "?"


def _gpu_unit_tests() -> dict:
    return run_pytest("tests/unit/transport/test_csrc_seqno_gpu.py")


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(LIB))
    vp, u64 = ctypes.c_void_p, ctypes.c_uint64
    lib.vd_seqno_probe_async.argtypes = [vp, u64, u64, vp, vp, vp, vp]
    lib.vd_seqno_write_async.argtypes = [vp, u64, vp, vp]
    lib.vd_seqno_probe_async.restype = lib.vd_seqno_write_async.restype = ctypes.c_int
    _check(lib.vd_seqno_preload(), "preload")  # lazy loading would deadlock the writer behind a spinning probe
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def _stream_write(lib: ctypes.CDLL) -> dict:
    """Writer kernel on another stream of this process: %globaltimer at write vs at observation."""
    import torch

    word = torch.zeros(2, dtype=torch.int64, device="cuda")  # [seqword, written_ns]
    stamps = torch.zeros(ITERS, dtype=torch.int64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    written = torch.zeros(ITERS, dtype=torch.int64, device="cuda")
    for i in range(ITERS):
        seq = i + 1
        _check(lib.vd_seqno_probe_async(word.data_ptr(), seq, MAX_SPINS, flag.data_ptr(), stamps[i].data_ptr(),
                                        None, consumer.cuda_stream), "probe launch")
        time.sleep(50e-6)  # the probe is spinning before the word changes
        _check(lib.vd_seqno_write_async(word.data_ptr(), seq, written[i].data_ptr(), producer.cuda_stream),
               "write launch")
        consumer.synchronize()
        producer.synchronize()
    if flag.item():
        raise RuntimeError("a probe timed out: a write was not observed")
    return _latency((stamps - written).cpu().tolist())


def _latency(ns: list[int]) -> dict:
    us = sorted(x / 1e3 for x in ns)
    return {"poll_to_observe_us": {"median": round(us[len(us) // 2], 3), "p90": round(us[int(0.9 * len(us))], 3),
                                   "min": round(us[0], 3), "max": round(us[-1], 3), "n": len(us)},
            "clock": "GPU %globaltimer at write and at observation (same clock)"}


def _peer_process_write() -> dict:
    """The writer is another process holding the word through CUDA IPC (torch's sharing)."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    word = torch.zeros(2 + ITERS, dtype=torch.int64, device="cuda")  # seqword, unused, written_ns[ITERS]
    commands, answers = ctx.Queue(), ctx.Queue()
    try:
        proc = ctx.Process(target=peer_writer, args=(word, str(LIB), commands, answers), daemon=True)
        proc.start()
        ready = answers.get(timeout=120)
    except Exception as err:  # a sandbox refusing cudaIpc* shows up here
        raise Unsupported(f"CUDA IPC to a peer process: {type(err).__name__}: {err}") from None
    if ready != "ready":
        raise Unsupported(f"CUDA IPC to a peer process: {ready}")
    lib = _load()
    stamps = torch.zeros(ITERS, dtype=torch.int64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    consumer = torch.cuda.Stream()
    try:
        for i in range(ITERS):
            _check(lib.vd_seqno_probe_async(word.data_ptr(), i + 1, MAX_SPINS, flag.data_ptr(), stamps[i].data_ptr(),
                                            None, consumer.cuda_stream), "probe launch")
            time.sleep(50e-6)
            commands.put(i + 1)
            answer = answers.get(timeout=30)
            if answer != "ok":
                raise RuntimeError(f"peer writer: {answer}")
            consumer.synchronize()
    finally:
        commands.put(None)
        proc.join(timeout=30)
    if flag.item():
        raise RuntimeError("a probe timed out: a peer write was not observed")
    return _latency((stamps - word[2:]).cpu().tolist())


def peer_writer(word, lib_path: str, commands, answers) -> None:  # runs in the spawned peer process
    import torch

    try:
        lib = ctypes.CDLL(lib_path)
        if lib.vd_seqno_preload():
            raise RuntimeError("vd_seqno_preload failed")
        lib.vd_seqno_write_async.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]
        stream = torch.cuda.Stream()
        answers.put("ready")
    except Exception as err:  # noqa: BLE001 - reported to the parent
        answers.put(f"{type(err).__name__}: {err}")
        return
    while (seq := commands.get()) is not None:
        rc = lib.vd_seqno_write_async(word.data_ptr(), seq, word[1 + seq].data_ptr(), stream.cuda_stream)
        stream.synchronize()
        answers.put("ok" if rc == 0 else f"CUDA error {rc}")


def _host_write(lib: ctypes.CDLL) -> dict:
    """CPU stores the word into pinned host memory; the probe acks into pinned memory."""
    import torch

    host = torch.zeros(2, dtype=torch.int64, pin_memory=True)  # [seqword, ack]: mapped (UVA)
    view = host.numpy()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    rtts = []
    for i in range(ITERS):
        seq = i + 1
        _check(lib.vd_seqno_probe_async(host.data_ptr(), seq, MAX_SPINS, flag.data_ptr(), None,
                                        host.data_ptr() + 8, stream.cuda_stream), "probe launch")
        rtts.append(_host_round_trip(view, seq))
    stream.synchronize()
    if flag.item():
        raise RuntimeError("a probe timed out")
    return _rtt_summary(rtts)


def _host_round_trip(view, seq: int, timeout_s: float = 5.0) -> float:
    time.sleep(100e-6)  # the kernel has started spinning
    t0 = time.perf_counter_ns()
    view[0] = seq
    deadline = time.monotonic() + timeout_s
    while view[1] != seq:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no ack for seq {seq} within {timeout_s}s")
    return (time.perf_counter_ns() - t0) / 1e3


def _rtt_summary(rtts: list[float]) -> dict:
    us = sorted(rtts)
    med = us[len(us) // 2]
    return {"rtt_us": {"median": round(med, 3), "p90": round(us[int(0.9 * len(us))], 3), "min": round(us[0], 3),
                       "n": len(us)},
            "poll_to_observe_us_estimate": round(med / 2, 3),
            "clock": "host perf_counter round trip (store -> GPU sees it -> ack store -> host sees it); "
                     "one-way is estimated as rtt/2"}


def _host_write_stream_memops() -> dict:
    """Baseline: cuStreamWaitValue64 on the word, then cuStreamWriteValue64 of the ack."""
    import torch

    try:
        from cuda.bindings import driver as cu
    except ImportError as err:
        raise Unsupported(f"cuda-bindings not importable: {err}") from None
    host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    view = host.numpy()
    stream = torch.cuda.Stream()
    handle = cu.CUstream(stream.cuda_stream)
    geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    rtts = []
    for i in range(ITERS):
        seq = i + 1
        err, = _memop(cu.cuStreamWaitValue64, handle, cu.CUdeviceptr(host.data_ptr()), seq, geq)
        if int(err):
            raise Unsupported(f"cuStreamWaitValue64 on pinned host memory: {err}")
        err, = _memop(cu.cuStreamWriteValue64, handle, cu.CUdeviceptr(host.data_ptr() + 8), seq, 0)
        if int(err):
            raise Unsupported(f"cuStreamWriteValue64: {err}")
        rtts.append(_host_round_trip(view, seq))
    stream.synchronize()
    return _rtt_summary(rtts)


def _memop(fn, stream, addr, value: int, flags):
    """cuda-bindings takes the 64-bit value as an int or as `cuuint64_t`, depending on its version."""
    from cuda.bindings import driver as cu

    try:
        return fn(stream, addr, value, flags)
    except TypeError:
        return fn(stream, addr, cu.cuuint64_t(value), flags)
