# SPDX-License-Identifier: Apache-2.0
"""The seqno-polling kernel on a real GPU (runs only when one is lent): a consumer queued behind
the wait does not run until the seqword arrives, and a spin bound raises the timeout flag
instead of hanging the stream. The NIC's WRITE of the seqword is stood in for by a copy from
another stream (the kernel cannot tell who wrote the word)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import time

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
CSRC = pathlib.Path(__file__).resolve().parents[3] / "csrc"


@pytest.fixture(scope="module")
def waiter():
    if not torch.cuda.is_available() or shutil.which("nvcc") is None:
        pytest.skip("needs a CUDA GPU and nvcc")
    major, minor = torch.cuda.get_device_capability()
    env = dict(os.environ, CUDA_ARCHS=f"{major}{minor}")
    subprocess.run([str(CSRC / "build.sh")], check=True, env=env, timeout=600)
    from vllm_disagg.transport.rdma.gpu import SeqnoWaiter

    return SeqnoWaiter(str(CSRC / "build" / "libvd_seqno.so"))


def test_consumer_behind_the_wait_runs_only_after_the_seqno_lands(waiter):
    seq = torch.zeros(1, dtype=torch.int64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    data = torch.zeros(1024, device="cuda")
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(consumer):
        waiter.enqueue(seq.data_ptr(), 7, consumer.cuda_stream, flag.data_ptr())  # launched ahead
        data.add_(1)
        done.record(consumer)
    time.sleep(0.2)
    assert not done.query(), "the consumer ran before the seqno arrived"
    with torch.cuda.stream(producer):
        seq.fill_(7)
    done.synchronize()
    assert data.sum().item() == 1024 and flag.item() == 0


def test_a_spin_bound_sets_the_timeout_flag_instead_of_hanging(waiter):
    seq = torch.zeros(1, dtype=torch.int64, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    waiter.enqueue(seq.data_ptr(), 1, s.cuda_stream, flag.data_ptr(), max_spins=1000)
    s.synchronize()
    assert flag.item() == 1
