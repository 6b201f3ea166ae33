# SPDX-License-Identifier: Apache-2.0
"""Soft-RoCE job: the `rdma` backend's cases on a real ibverbs stack (rdma_rxe) without a NIC.

Boots Debian's kernel under qemu TCG with no NIC (`tests/rdma/run_softroce_vm.sh`), runs
`tests/rdma/rdma_cases.py` inside and parses its `RDMA-CASE PASS|FAIL` console lines. Where this
machine already has an ibverbs device, the same cases run natively instead (no VM). Host needs:
qemu-system-x86, busybox-static, cpio and an apt index with Debian 12's linux-image-6.1.0-*-amd64.
Takes ~2-3 min (functional, TCG speed); debs are cached in ~/.cache/vllm-disagg/softroce.
"""

from __future__ import annotations

import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import pytest

from vllm_disagg.transport.rdma import probe_ibverbs

pytestmark = [pytest.mark.rdma, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "rdma" / "run_softroce_vm.sh"
CASES = REPO / "tests" / "rdma" / "rdma_cases.py"
LINE = re.compile(r"^RDMA-CASE (PASS|FAIL) (\S+)", re.M)


def _case_names() -> set[str]:
    return set(re.findall(r"^def case_(\w+)\(", CASES.read_text(), re.M))


def _vm_missing() -> str | None:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return "the soft-RoCE VM job needs an x86_64 Linux host"
    for tool in ("qemu-system-x86_64", "apt-get", "apt-cache", "dpkg-deb", "cpio"):
        if shutil.which(tool) is None:
            return f"host tool {tool!r} missing (apt-get install qemu-system-x86 busybox-static cpio)"
    out = subprocess.run(
        ["apt-cache", "search", "--names-only", r"^linux-image-6\.1\.0-[0-9]+-amd64$"],
        capture_output=True,
        text=True,
    )
    if not out.stdout.strip():
        return "apt knows no linux-image-6.1.0-*-amd64 (needs Debian 12 sources and apt-get update)"
    return None


def _assert_all_cases_passed(output: str) -> None:
    results = dict((name, verdict) for verdict, name in LINE.findall(output))
    assert "RDMA-SUITE DONE rc=0" in output, output[-6000:]
    assert set(results) == _case_names(), f"cases reported {sorted(results)}"
    assert all(v == "PASS" for v in results.values()), results


def test_rdma_cases_pass_on_a_real_ibverbs_stack():
    if probe_ibverbs() is None:  # a native device: same cases, no VM
        out = subprocess.run([sys.executable, str(CASES)], capture_output=True, text=True, timeout=900)
        _assert_all_cases_passed(out.stdout)
        return
    missing = _vm_missing()
    if missing is not None:
        pytest.skip(missing)
    env = dict(
        os.environ, SOFTROCE_FORCE_VM="1", SOFTROCE_TIMEOUT_S=os.environ.get("SOFTROCE_TIMEOUT_S", "720")
    )
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=1200, env=env)
    assert "SOFTROCE-READY" in out.stdout, f"VM did not come up (rc={out.returncode}):\n{out.stderr[-4000:]}"
    _assert_all_cases_passed(out.stdout)
    assert out.returncode == 0, out.stderr[-4000:]
