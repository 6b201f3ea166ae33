# SPDX-License-Identifier: Apache-2.0
"""The GPU kit without a GPU: its wheel-set checks and each step's CPU twin (the same code paths and
JSON shape as on the lent machine, at toy sizes; their figures are never results). The dry run
itself runs in `make test` (`benchmarks/gpu_check.py --dry-run`)."""

from __future__ import annotations

import json
import shutil
import zipfile

import gpu_check
import pytest
import wheels
from common import FAILED, OK, SKIPPED, STATUSES, Budget


def _fake_wheel(path, members: dict[str, bytes]) -> None:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", record)


def test_slimming_drops_the_members_and_their_record_lines(tmp_path):
    path = tmp_path / "pkg-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    _fake_wheel(path, {"pkg/__init__.py": b"x = 1\n", "pkg_ep/big.so": b"\0" * 50_000, "pkg/libs/perf.so": b"1"})
    saved = wheels.slim(path, ("pkg_ep/", "pkg/libs/perf"))
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert saved > 0 and names == ["pkg/__init__.py", "pkg-1.0.dist-info/RECORD"]
    assert "pkg_ep" not in record and "perf" not in record and "pkg/__init__.py" in record


def test_the_locked_wheel_set_matches_wheels_txt_and_fits_a_device_call():
    lock = wheels.lock()
    assert {wheels._norm(w["file"].split("-")[0]) for w in lock["wheels"]} == {wheels._norm(n) for n, _ in wheels.specs()}
    travel = wheels.travel_bytes()
    assert travel["fits"], travel
    assert wheels.check(dest=wheels.REPO / "no-such-dir")["built"] is False


def test_a_built_set_with_a_stray_or_second_version_is_refused(tmp_path):
    for entry in wheels.lock()["wheels"]:  # stand-ins of the locked files, at their locked sizes
        (tmp_path / entry["file"]).write_bytes(b"\0" * entry["bytes"])
    assert wheels.check(dest=tmp_path)["problems"] == []
    (tmp_path / "pydantic-2.0.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "torch-2.11.0-cp312-cp312-win_amd64.whl").write_bytes(b"")
    problems = " ".join(wheels.check(dest=tmp_path)["problems"])
    assert "two versions of pydantic" in problems and "not installable on cp312 manylinux" in problems


def test_each_step_fits_a_call_and_all_four_fit_the_session():
    budgets = [budget for _, budget, _ in gpu_check.STEPS.values()]
    assert max(budgets) <= gpu_check.CALL_LIMIT_S and sum(budgets) <= gpu_check.SESSION_LIMIT_S
    for step in gpu_check.STEPS:
        call = gpu_check.device_call(step)
        assert call["carry"] == [".whl"] and call["timeout_s"] <= 600 and len(call["command"]) < 2000


def _twin(step: str, tmp_path) -> dict:
    import importlib

    module = importlib.import_module(gpu_check.STEPS[step][0])
    result = module.run_step("cpu", Budget(240))
    path = result.write(tmp_path)
    data = json.loads(path.read_text())
    assert path.name == f"gpu_check_{step}_cpu_twin.json" and data["measured_on_gpu"] is False
    assert tuple(data["checks"]) == module.CHECKS  # the twin reports every check the GPU run does
    assert all(c["status"] in STATUSES for c in data["checks"].values())
    assert not data["failed_checks"], {n: c.get("error") for n, c in data["checks"].items() if c["status"] == FAILED}
    return data


def test_step_a_twin_skips_every_gpu_check_with_its_reason(tmp_path):
    data = _twin("a", tmp_path)
    assert all(data["checks"][n]["status"] == SKIPPED for n in data["checks"] if n != "build")
    assert data["checks"]["build"]["status"] == (OK if shutil.which("nvcc") else SKIPPED)


def test_step_b_twin_runs_the_executor_over_the_torch_decoder_layer(tmp_path):
    checks = _twin("b", tmp_path)["checks"]
    for name in ("executor", "executor_contiguous_kv"):  # KV gathered from blocks, or read in place
        runs = checks[name]["runs"]
        assert {"plain", "nano_inline", "overlap_cpu_threads"} <= set(runs)
        assert all(r["rel_error_vs_plain"] < 1e-5 for n, r in runs.items() if n != "plain")
    assert checks["executor_contiguous_kv"]["kv_layout"] == "contiguous"


def test_step_c_kernel_exactness_twin_merges_partitions_exactly():
    import lamina_gpu

    out = lamina_gpu.kernel_exactness("cpu", lamina_gpu.GEOM_TWIN, "float32", [5, 17, 40, 9])
    errors = out["rel_error_vs_float64"]
    assert set(errors) == {"full", "head_partition_2", "head_partition_4", "request_partition_2",
                           "send_q_early_lse_merge", "sequence_split_lse_merge"}
    assert max(errors.values()) < 1e-5


@pytest.mark.parametrize("kind", ["ipc", "nixl"])
def test_step_d_twin_pushes_every_layer_after_its_event_between_two_processes(kind):
    import kv_push_gpu

    if kind == "nixl":
        pytest.importorskip("nixl")
    out = kv_push_gpu.push("cpu", kv_push_gpu.TWIN, kind)
    assert out["stale_layers"] == [] and len(out["per_layer_wait_ms"]) == kv_push_gpu.TWIN.num_layers


def test_the_import_probe_blocks_what_the_device_lacks(monkeypatch):
    """The dry run's proof that step modules load without vLLM: a module that needs vLLM must fail it."""
    monkeypatch.setitem(gpu_check.STEPS, "z", ("decoder", 1, ("vllm_disagg.kv.push_sender",)))
    errors = gpu_check.import_check(["z"])
    assert errors["decoder"] == "" and errors["vllm-disagg plan nanoflow"] == ""
    assert "vllm" in errors["vllm_disagg.kv.push_sender"] and "not on the lent machine" in errors["vllm_disagg.kv.push_sender"]
