# SPDX-License-Identifier: Apache-2.0
"""The Ray chaos deployment's pieces that run without a Ray cluster: its routers find the instances
through GCS, not a static list; a `kill` on a Ray instance hits the actor process or the server
group (real processes here), and a deployment that never came up lists no instances instead of
starting a Ray cluster of its own."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from vllm_disagg.testing.chaos.faults import FaultInjector
from vllm_disagg.testing.chaos.ray_deployment import NAMESPACE, RayDeployment

pytest.importorskip("ray", reason="pip install 'ray[default]'")


def _sleeper(new_group: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=new_group)


class _OneInstance:
    """The injector's view of a deployment: one decode instance with a server group and an actor."""

    def __init__(self, server: subprocess.Popen, actor: subprocess.Popen) -> None:
        self.inst = {"name": "vllm-disagg:decode0", "role": "decode", "pid": server.pid, "actor_pid": actor.pid}

    def pick(self, role, rng):
        return self.inst


def _dead(proc: subprocess.Popen, timeout_s: float = 10.0) -> bool:
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.parametrize("seed", range(6))
def test_a_kill_on_a_ray_instance_hits_either_the_actor_or_the_server_group_and_says_which(seed):
    server, actor = _sleeper(new_group=True), _sleeper(new_group=False)
    try:
        fault = FaultInjector(_OneInstance(server, actor), random.Random(seed), log=lambda _: None).kill("decode")
        hit_actor = "actor_pid" in fault.detail
        assert _dead(actor if hit_actor else server)
        time.sleep(0.2)
        assert (server if hit_actor else actor).poll() is None  # only the one chosen
    finally:
        for p in (server, actor):
            p.kill()
            p.wait()


def test_both_targets_come_up_over_a_few_kills():
    hits = set()
    for seed in range(12):
        server, actor = _sleeper(new_group=True), _sleeper(new_group=False)
        try:
            fault = FaultInjector(_OneInstance(server, actor), random.Random(seed), log=lambda _: None).kill("d")
            hits.add("actor" if "actor_pid" in fault.detail else "server")
        finally:
            for p in (server, actor):
                p.kill()
                p.wait()
    assert hits == {"actor", "server"}


def test_the_routers_discover_the_instances_through_gcs(tmp_path):
    dep = RayDeployment(tmp_path, "model", gcs_port=6399)
    dep.router_port = 8123
    cmd = dep._router_cmd()
    assert cmd[cmd.index("--discovery") + 1] == "ray"
    assert cmd[cmd.index("--ray-address") + 1] == "127.0.0.1:6399"
    assert cmd[cmd.index("--ray-namespace") + 1] == NAMESPACE
    assert "--prefill" not in cmd and "--reuse-port" in cmd


def test_before_ray_is_joined_there_are_no_instances_and_no_cluster_is_started(tmp_path):
    import ray

    dep = RayDeployment(tmp_path, "model")
    assert not ray.is_initialized()
    assert dep.instances() == [] and not ray.is_initialized()


def test_slow_links_are_refused_on_ray_before_anything_starts(tmp_path):
    dep = RayDeployment(tmp_path, "model", slow_link=True)
    with pytest.raises(ValueError, match="local backend"):
        dep.start()
    assert dep.up is None and os.listdir(tmp_path) == []


def test_stopping_keeps_rays_logs_in_the_work_dir_and_removes_its_temp_dir(tmp_path):
    """Each Ray chaos run left its /tmp/vdray-* dir behind; its logs belong with the run's other logs."""
    ray_dir = tmp_path / "vdray-x"
    session = ray_dir / "session_2026-11-29_07-45-10_1"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "raylet.out").write_text("raylet")
    (ray_dir / "session_latest").symlink_to(session)
    work = tmp_path / "work"
    work.mkdir()
    dep = RayDeployment(work, "model", ray_dir=ray_dir)
    dep._keep_ray_logs()
    assert (work / "ray-logs" / "raylet.out").read_text() == "raylet"
    assert not ray_dir.exists() and dep.ray_dir is None
    dep._keep_ray_logs()  # stopping twice is harmless
