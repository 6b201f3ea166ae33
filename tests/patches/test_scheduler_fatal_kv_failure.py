# SPDX-License-Identifier: Apache-2.0
"""P4: applies on 0.32, is a no-op for other connectors, and is idempotent."""

import importlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from vllm_disagg.patches import scheduler_fatal_kv_failure as patch  # noqa: E402


def test_the_patch_applies_and_is_idempotent_under_reload():
    assert patch.apply()
    wrapped = Scheduler.update_from_output
    importlib.reload(patch)
    assert patch.apply()
    assert Scheduler.update_from_output is wrapped
    assert Scheduler._vllm_disagg_original_update_from_output is not wrapped


def scheduler_with(connector, status=RequestStatus.WAITING_FOR_REMOTE_KVS):
    return SimpleNamespace(connector=connector, requests={"r1": SimpleNamespace(status=status)})


def test_connectors_without_the_hook_never_fail_a_request():
    kv_output = SimpleNamespace(failed_recving={"r1"})
    assert patch.fatal_request_ids(scheduler_with(object()), kv_output) == set()
    assert patch.fatal_request_ids(scheduler_with(None), kv_output) == set()


def test_only_fatal_failures_of_waiting_requests_are_selected():
    connector = SimpleNamespace(is_fatal_load_failure=lambda r: r == "r1")
    assert patch.fatal_request_ids(scheduler_with(connector), SimpleNamespace(failed_recving={"r1", "r9"})) == {"r1"}
    running = scheduler_with(connector, status=RequestStatus.RUNNING)
    assert patch.fatal_request_ids(running, SimpleNamespace(failed_recving={"r1"})) == set()
    assert patch.fatal_request_ids(scheduler_with(connector), None) == set()
