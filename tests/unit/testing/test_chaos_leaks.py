# SPDX-License-Identifier: Apache-2.0
"""The chaos run's leak comparison: KV leaks count blocks, and /dev/shm counts only orphans."""

from vllm_disagg.testing.chaos.leaks import compare, settled_snapshot


def _instance(pid: int, usage: float, threads: int = 10) -> dict:
    return {"role": "decode", "pid": pid, "processes": 3, "threads": threads, "sockets": 4, "thread_names": {},
            "vllm:kv_cache_usage_perc": usage, "vllm:num_requests_running": 0.0,
            "vllm:num_requests_waiting": 0.0, "num_gpu_blocks": 200.0}


def test_a_restarted_instance_is_compared_with_its_role_and_kv_leaks_count_blocks():
    before = {"instances": {"decode0": _instance(1, 0.0)}, "shm": [], "shm_mapped": []}
    after = {"instances": {"decode0": _instance(2, 0.05, threads=11)}, "shm": [], "shm_mapped": []}
    diff = compare(before, after)
    assert diff["kv_blocks_leaked"] == 10  # 5 % of 200 blocks
    assert list(diff["leaks"]) == ["decode0"] and "kv_cache_usage" in diff["leaks"]["decode0"][0]


def test_new_shm_entries_that_a_live_process_maps_are_not_leaks_and_semaphores_wait_for_the_stop():
    before = {"instances": {}, "shm": ["old"], "shm_mapped": []}
    after = {"instances": {}, "shm": ["old", "psm_live", "sem.mp-unmapped", "psm_orphan"], "shm_mapped": ["psm_live"]}
    diff = compare(before, after)
    assert diff["new_shm"] == ["psm_orphan"] and diff["shm_segments_leaked"] == 1


def test_blocks_held_for_a_bounded_time_are_waited_for_and_a_real_leak_is_reported_at_the_bound():
    """P holds a push's blocks until its push timeout when the router that carried the request died
    before D registered: held at the first look, free at the second."""
    before = {"instances": {"prefill0": _instance(1, 0.0)}, "shm": [], "shm_mapped": []}
    looks = iter([0.015, 0.0])
    end, waited = settled_snapshot(lambda: {"instances": {"prefill0": _instance(1, next(looks))}, "shm": [],
                                            "shm_mapped": []}, before, bound_s=5.0, period_s=0.01)
    assert compare(before, end)["kv_blocks_leaked"] == 0 and waited < 1.0
    end, waited = settled_snapshot(lambda: {"instances": {"prefill0": _instance(1, 0.015)}, "shm": [],
                                            "shm_mapped": []}, before, bound_s=0.05, period_s=0.01)
    assert compare(before, end)["kv_blocks_leaked"] == 3 and waited >= 0.05
