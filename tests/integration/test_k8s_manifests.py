# SPDX-License-Identifier: Apache-2.0
"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates offline against the Kubernetes
schemas (`kubernetes-validate`, strict), and agrees with what the plugin's processes expose.

Agreement checks: probe ports name container ports; Prometheus annotations name a container port;
headless pool Services name the ports the router's Kubernetes discovery reads (`http`, `kv`);
every vLLM/attention container gets the pod IP (downward API) and the token (Secret); every
`vllm serve` command line (Deployments and the LeaderWorkerSet leader scripts) parses with vLLM's own
parser plus the plugin flags into the intended role and KV port; HPA targets exist and their metric
names come from the router's real /metrics. Then the rendered router and attention-server container
commands are started, each in its own loopback-only network namespace (like a pod: the manifest's
ports as-is), and their readiness/liveness paths are probed on those ports.

CRDs the validator has no schema for (LeaderWorkerSet) are checked structurally, and their pod
templates validated as core/v1 PodTemplates.

Needs: `kubectl` with kustomize (Debian: kubernetes-client; or $KUBECTL), `kubernetes-validate` (PyPI).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from vllm_disagg.testing.netns import Netns
from vllm_disagg.testing.netns import prereqs as netns_prereqs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "gpu-rdma", "lamina-cpu"]
KUBECTL = os.environ.get("KUBECTL") or shutil.which("kubectl")
K8S_VERSIONS = ["1.29.0"]  # oldest we claim (autoscaling/v2, LWS v1) ...
STRUCTURAL_KINDS = {"LeaderWorkerSet"}
ROUTER_HEALTH = "/health"  # 200 once a decode instance is up: readiness
ROUTER_ALIVE = "/metrics"  # 200 whenever the process serves: liveness

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
K8S_VERSIONS.append(kv.latest_version())  # ... and the newest the validator knows
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (apt-get install kubernetes-client)")


def render(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: render(o) for o in OVERLAYS}


def objects(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(owner, PodTemplateSpec) of every workload, LeaderWorkerSet leader and worker included."""
    out = []
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet"):
            out.append((name, d["spec"]["template"]))
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            out += [(f"{name}/leader", lwt["leaderTemplate"]), (f"{name}/worker", lwt["workerTemplate"])]
    return out


def container_env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


# ------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_with_kubectl_kustomize(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Service", "StatefulSet", "HorizontalPodAutoscaler", "ConfigMap", "Role"} <= kinds
    assert all(d["metadata"].get("namespace") == "vllm-disagg" for d in docs if d["kind"] != "Namespace")


def test_the_base_has_the_pools_as_deployments_and_the_gpu_overlays_as_leaderworkersets(rendered):
    for overlay in ("cpu", "lamina-cpu"):
        names = {d["metadata"]["name"] for d in objects(rendered[overlay], "Deployment")}
        assert names == {"vllm-disagg-prefill", "vllm-disagg-decode", "vllm-disagg-router"}
    for overlay in ("gpu", "gpu-rdma"):
        assert {d["metadata"]["name"] for d in objects(rendered[overlay], "Deployment")} == {"vllm-disagg-router"}
        assert {d["metadata"]["name"] for d in objects(rendered[overlay], "LeaderWorkerSet")} == {
            "vllm-disagg-prefill", "vllm-disagg-decode"}


# ----------------------------------------------------------------------------------- validate
@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, overlay, version):
    structural = []
    for doc in rendered[overlay]:
        try:
            kv.validate(doc, version, strict=True)
        except kv.SchemaNotFoundError:
            structural.append(doc)
        except kv.ValidationError as err:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']} invalid for {version} at "
                        f"{list(err.path)}: {err.message}")
    assert {d["kind"] for d in structural} <= STRUCTURAL_KINDS
    for doc in structural:
        check_leaderworkerset(doc, version)


def check_leaderworkerset(doc: dict, version: str) -> None:
    """No schema for the CRD: check its shape, and validate its pod templates as core/v1."""
    assert doc["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert isinstance(doc["spec"]["replicas"], int)
    lwt = doc["spec"]["leaderWorkerTemplate"]
    assert isinstance(lwt["size"], int) and lwt["size"] >= 2
    assert lwt["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    assert set(doc["spec"]) <= {"replicas", "startupPolicy", "leaderWorkerTemplate", "rolloutStrategy",
                                "networkConfig"}
    for part in ("leaderTemplate", "workerTemplate"):
        wrapper = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": f"{doc['metadata']['name']}-{part.lower()}"}, "template": lwt[part]}
        kv.validate(wrapper, version, strict=True)


# ---------------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_scrape_annotations_name_declared_container_ports(rendered, overlay):
    for owner, tmpl in pod_templates(rendered[overlay]):
        ports = {p["name"]: p["containerPort"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        for c in tmpl["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in ports, f"{owner}: {probe} port not declared"
        ann = tmpl["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            assert int(ann["prometheus.io/port"]) in ports.values(), owner
            assert ann["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_services_are_headless_and_name_the_ports_the_router_discovers(rendered, overlay):
    docs = rendered[overlay]
    router = one(docs, "Deployment", "vllm-disagg-router")["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert args[args.index("--discovery") + 1] == "kubernetes"
    for role in ("prefill", "decode"):
        svc = one(docs, "Service", args[args.index(f"--k8s-{role}-service") + 1])
        assert svc["spec"]["clusterIP"] == "None"
        assert {p["name"] for p in svc["spec"]["ports"]} >= {"http", "kv"}
        # The Service selects exactly the pods serving that role (LWS: leaders only).
        selected = [(o, t) for o, t in pod_templates(docs)
                    if all(t["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())]
        assert len(selected) == 1, (role, [o for o, _ in selected])
        container_ports = {p["name"]: p["containerPort"] for p in selected[0][1]["spec"]["containers"][0]["ports"]}
        for p in svc["spec"]["ports"]:
            assert container_ports[p["targetPort"]] == p["port"]
    role = one(docs, "Role", "vllm-disagg-endpoints-reader")
    assert {"get", "list"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["endpoints"]
    binding = one(docs, "RoleBinding", "vllm-disagg-router-endpoints")
    assert binding["subjects"][0]["name"] == router["serviceAccountName"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_instance_gets_the_pod_ip_and_the_token_from_the_secret(rendered, overlay):
    instances = [(o, t) for o, t in pod_templates(rendered[overlay]) if "router" not in o]  # router: HTTP only
    assert len(instances) == (5 if overlay.startswith("gpu") else 3)  # LWS: leader + worker templates
    for owner, tmpl in instances:
        for c in tmpl["spec"]["containers"]:
            env = container_env(c)
            assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", owner
            ref = env["VLLM_DISAGG_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("vllm-disagg-auth", "token"), owner


def test_the_rdma_overlay_uses_host_network_rdma_devices_and_nixl(rendered):
    for lws in objects(rendered["gpu-rdma"], "LeaderWorkerSet"):
        for part in ("leaderTemplate", "workerTemplate"):
            spec = lws["spec"]["leaderWorkerTemplate"][part]["spec"]
            assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            c = spec["containers"][0]
            assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
        assert container_env(leader)["DISAGG_TRANSPORT"]["value"] == "nixl"


def _config_env(docs: list[dict]) -> dict[str, str]:
    return dict(one(docs, "ConfigMap", "vllm-disagg-config")["data"])


def _substitute(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion, and the shell's "$VAR" for the LWS scripts."""
    arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), arg)


def vllm_serve_commands(docs: list[dict]) -> list[tuple[str, list[str], dict]]:
    """(owner, argv after `vllm serve`, container) of every vLLM container, env substituted."""
    env = {**_config_env(docs), "VLLM_HOST_IP": "10.0.0.7", "POD_NAMESPACE": "vllm-disagg",
           "DISAGG_TRANSPORT": "tcp"}
    out = []
    for owner, tmpl in pod_templates(docs):
        for c in tmpl["spec"]["containers"]:
            cenv = {**env, **{k: v["value"] for k, v in container_env(c).items() if "value" in v}}
            if c.get("command") == ["vllm", "serve"]:
                out.append((owner, [_substitute(a, cenv) for a in c["args"]], c))
            elif c.get("command", [])[:2] == ["/bin/bash", "-c"] and "vllm serve" in c["args"][0]:
                script = c["args"][0].replace("\\\n", " ")
                line = next(ln for ln in script.splitlines() if "vllm serve" in ln)
                argv = shlex.split(_substitute(line, cenv))
                out.append((owner, argv[argv.index("serve") + 1:], c))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_serve_command_parses_with_the_plugin_into_its_role_and_kv_port(rendered, overlay):
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_disagg
    from vllm_disagg.cli.flags import merge_flags_into_namespace

    vllm_disagg.register()
    parser = make_arg_parser(FlexibleArgumentParser())
    commands = vllm_serve_commands(rendered[overlay])
    assert len(commands) == 2, [o for o, _, _ in commands]
    for owner, argv, container in commands:
        model, rest = argv[0], argv[1:]
        assert not model.startswith("$"), f"{owner}: model not substituted: {model}"
        args = parser.parse_args(["--model", model, *rest])
        merge_flags_into_namespace(args)
        disagg = args.additional_config["disagg"]
        role = owner.split("vllm-disagg-")[1].split("/")[0]
        assert disagg["role"] == role, owner
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert disagg["kv"]["kv_port"] == ports["kv"] and args.port == ports["http"], owner
        assert args.host == "0.0.0.0"  # kubelet probes the pod IP
        if overlay == "lamina-cpu" and role == "decode":
            ra = disagg["remote_attention"]
            assert ra["transport"] == "tcp" and len(ra["servers"]) == 2
            # auto: request-wise for SmolLM2's 3 KV heads on 2 workers (head-wise where 2 divides the heads)
            assert ra["partition"] == "auto" and ra["replacement_wait_s"] >= 120  # waits for the pod's restart
            sts = one(rendered[overlay], "StatefulSet", "vllm-disagg-attention")
            assert sts["spec"]["replicas"] == len(ra["servers"])
            assert all(s.endswith(f".{sts['spec']['serviceName']}:8300") for s in ra["servers"])
        # P allocates as the model worker it pushes into (one KV cache group, handshake kv_groups)
        assert bool(args.disable_hybrid_kv_cache_manager) == (overlay == "lamina-cpu" and role == "prefill")


def attention_server_args(docs: list[dict]) -> tuple[argparse.Namespace, dict]:
    """The attention StatefulSet's `vllm-disagg attn-server` args, parsed by its real parser."""
    from vllm_disagg.attention.cli import add_server_args

    container = one(docs, "StatefulSet", "vllm-disagg-attention")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["vllm-disagg", "attn-server"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_server_args(parser)
    args = parser.parse_args([_substitute(a, {"VLLM_HOST_IP": "10.0.0.9"}) for a in container["args"]])
    return args, {p["name"]: p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_attention_server_listens_on_its_declared_ports(rendered, overlay):
    args, ports = attention_server_args(rendered[overlay])
    assert args.http_port == ports["http"] and args.data_port == ports["data"]
    assert args.kv_port == ports.get("kv", 0)  # a fixed prefill KV port is declared where one listens


def test_lamina_prefill_pushes_into_the_attention_servers_of_its_one_decode_model_worker(rendered):
    """Same wiring as `vllm-disagg up --prefill 1 --decode 1 --attention 2`: the servers accept the prefill
    pool's kv.transport (`--kv-transport`) and the decode pod is their only model worker."""
    pytest.importorskip("vllm")
    docs = rendered["lamina-cpu"]
    args, ports = attention_server_args(docs)
    serve = {o.split("vllm-disagg-")[1].split("/")[0]: argv for o, argv, _ in vllm_serve_commands(docs)}
    prefill_transport = serve["prefill"][serve["prefill"].index("--disagg-transport") + 1]
    assert args.kv_transport == prefill_transport and args.kernel == "cpu"  # pushes land in the CPU layout
    assert args.kv_port == ports["kv"] and args.transport == "tcp"
    decode = one(docs, "Deployment", "vllm-disagg-decode")["spec"]
    assert decode["replicas"] == 1 and decode["strategy"]["type"] == "Recreate"
    assert one(docs, "HorizontalPodAutoscaler", "vllm-disagg-decode")["spec"]["maxReplicas"] == 1
    for overlay in ("gpu", "gpu-rdma"):  # cuda kernel: no CPU-layout pushes, D recomputes
        assert attention_server_args(rendered[overlay])[0].kv_transport is None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpas_scale_existing_pools_on_metrics_the_adapter_rules_expose(rendered, overlay):
    docs = rendered[overlay]
    rules = yaml.safe_load(yaml.safe_load((K8S / "extras" / "prometheus-adapter-rules.yaml").read_text())
                           ["data"]["config.yaml"])["externalRules"]
    exposed = {r["name"]["as"]: re.search(r'__name__="([^"]+)"', r["seriesQuery"]).group(1) for r in rules}
    hpas = objects(docs, "HorizontalPodAutoscaler")
    assert {h["metadata"]["name"] for h in hpas} == {"vllm-disagg-prefill", "vllm-disagg-decode"}
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        one(docs, ref["kind"], ref["name"])
        for m in hpa["spec"]["metrics"]:
            assert m["external"]["metric"]["name"] in exposed
            assert m["external"]["metric"]["selector"]["matchLabels"]["pool"] in ("prefill", "decode")
    from vllm_disagg.router.metrics import RouterMetrics

    series = RouterMetrics().render().decode()
    for prom_name in exposed.values():
        assert f"# TYPE {prom_name} gauge" in series, prom_name


# ------------------------------------------------------------------------------- run locally
class PodNetns(Netns):
    """A loopback-only network namespace standing in for one pod's network."""

    def __init__(self) -> None:
        super().__init__(prefix="vdk8s")

    def popen(self, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], env=env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, port: int, path: str) -> tuple[int, str]:
        """HTTP GET from inside the namespace (the kubelet's view of the pod)."""
        code = ("import sys, urllib.request, urllib.error\n"
                "try:\n r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n print(e.code); print(e.read().decode())\n"
                "except OSError as e:\n print(0); print(e)\n")
        out = subprocess.run(["ip", "netns", "exec", self.name, sys.executable, "-c", code,
                              f"http://127.0.0.1:{port}{path}"], capture_output=True, text=True, timeout=30)
        status, _, body = out.stdout.partition("\n")
        return int(status or 0), body

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], check=False)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _rendered_argv(container: dict, env: dict[str, str]) -> list[str]:
    exe = Path(sys.executable).with_name(container["command"][0])
    assert exe.exists(), f"{container['command'][0]} is not installed next to {sys.executable}"
    return [str(exe), *container["command"][1:], *[_substitute(a, env) for a in container["args"]]]


def _wait_port(pod: PodNetns, proc: subprocess.Popen, port: int, path: str, log: Path, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        status, body = pod.get(port, path)
        if status:
            return status, body
        time.sleep(1)
    pytest.fail(f"nothing answered on port {port} after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _probe(container: dict, kind: str) -> tuple[int, str]:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container[kind]["httpGet"]
    return ports[probe["port"]], probe["path"]


def _router_knows_discovery() -> bool:
    out = subprocess.run([sys.executable, "-m", "vllm_disagg.cli.main", "router", "--help"],
                         capture_output=True, text=True, timeout=60)
    return "--discovery" in out.stdout


@pytest.mark.slow
def test_the_rendered_router_command_serves_its_probe_paths_on_its_port(rendered, tmp_path):
    if reason := netns_prereqs():
        pytest.skip(reason)
    if not _router_knows_discovery():
        pytest.skip("`vllm-disagg router` has no --discovery flag yet (.coord/scaleout_requests.md #1)")
    docs = rendered["cpu"]
    container = one(docs, "Deployment", "vllm-disagg-router")["spec"]["template"]["spec"]["containers"][0]
    # No API server here: discovery finds no instances, exactly a router before any decode pod is ready.
    env = {**os.environ, "POD_NAMESPACE": "vllm-disagg", "KUBERNETES_SERVICE_HOST": "127.0.0.1",
           "KUBERNETES_SERVICE_PORT": "1"}
    pod, log = PodNetns(), tmp_path / "router.log"
    try:
        proc = pod.popen(_rendered_argv(container, env), env, log)
        try:
            live_port, live_path = _probe(container, "livenessProbe")
            status, body = _wait_port(pod, proc, live_port, live_path, log)
            assert (live_path, status) == (ROUTER_ALIVE, 200)
            assert "vllm:disagg_router_queue_tokens" in body
            ready_port, ready_path = _probe(container, "readinessProbe")
            status, body = pod.get(ready_port, ready_path)
            assert (ready_path, status) == (ROUTER_HEALTH, 503), body  # not ready: no decode instance
            assert json.loads(body)["instances"] == []
        finally:
            _stop(proc)
    finally:
        pod.delete()


@pytest.mark.slow
def test_the_rendered_attention_server_command_serves_its_probe_paths_on_its_port(rendered, tmp_path):
    if reason := netns_prereqs():
        pytest.skip(reason)
    docs = rendered["lamina-cpu"]
    sts = one(docs, "StatefulSet", "vllm-disagg-attention")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {**os.environ, **_config_env(docs), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_DISAGG_AUTH_TOKEN": uuid.uuid4().hex}
    argv = _rendered_argv(container, env)
    argv[argv.index("--kv-cache-gib") + 1] = "0.125"  # the manifest's 4 GiB is the pod's, not this box's
    pod, log = PodNetns(), tmp_path / "attention.log"
    try:
        proc = pod.popen(argv, env, log)
        try:
            for kind in ("readinessProbe", "livenessProbe"):
                port, path = _probe(container, kind)
                status, body = _wait_port(pod, proc, port, path, log)
                assert status == 200, body
                info = json.loads(body)
                assert info["status"] == "ok" and info["transport"] == "tcp" and info["kv_transport"] == "tcp"
                data_port = {p["name"]: p["containerPort"] for p in container["ports"]}["data"]
                assert info["address"] == f"127.0.0.1:{data_port}"  # data path on VLLM_HOST_IP (the pod IP)
            ann = sts["spec"]["template"]["metadata"]["annotations"]
            status, body = pod.get(int(ann["prometheus.io/port"]), ann["prometheus.io/path"])
            assert status == 200 and "vllm:disagg_attention" in body
        finally:
            _stop(proc)
    finally:
        pod.delete()
