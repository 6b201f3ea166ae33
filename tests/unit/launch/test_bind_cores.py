# SPDX-License-Identifier: Apache-2.0
"""The local launcher binds an instance's whole process tree to its cores, not only vLLM's threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_disagg.launch.local import bind_process, parse_cores

CHILD = """
import json, os, subprocess, sys, threading, time
time.sleep(0.5)  # the launcher binds right after Popen returns; what starts later inherits it
seen = {}
t = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))
t.start(); t.join()
grand = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout
print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "thread": seen["thread"], "grandchild": json.loads(grand)}))
"""


@pytest.mark.parametrize("text, cores", [("0", {0}), ("2-3", {2, 3}), ("0,2-3", {0, 2, 3}), ("5,1", {1, 5})])
def test_core_lists_parse_like_vllms_omp_bind_syntax(text, cores):
    assert parse_cores(text) == cores


def test_a_bound_child_its_threads_and_its_children_all_stay_on_the_cores():
    core = min(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    bind_process(proc.pid, str(core))
    out, _ = proc.communicate(timeout=60)
    assert json.loads(out) == {"main": [core], "thread": [core], "grandchild": [core]}


def test_binding_a_child_that_already_exited_only_warns():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    bind_process(proc.pid, "0")  # no exception: the launcher's restart path must not die on it
