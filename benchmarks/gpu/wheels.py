# SPDX-License-Identifier: Apache-2.0
"""The wheel set the GPU kit carries to the lent machine, and what travels with a device call.

The lent machine has Python 3.12, torch, cuda-bindings and pytest, no network and no vLLM; the kit
needs a few more packages (`wheels.txt`: pydantic for the `vllm-disagg` CLI, nixl for step d).
`build` downloads them for cp312 manylinux x86_64 (the device README's `pip download` recipe) into
`.whl/` (gitignored), drops the parts of nixl-cu13 the kit never loads (its `nixl_ep` expert-parallel
extension built for other torch versions, UCX's perftest) and writes `wheels.lock.json`.
`check` verifies a built set against the lock; `travel_bytes` sums what a call sends (tracked and
untracked-not-ignored files plus the carried paths), which must stay under 64 MiB.

    python benchmarks/gpu/wheels.py build     # = make gpu-wheels
    python benchmarks/gpu/wheels.py check
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SPECS = HERE / "wheels.txt"
LOCK = HERE / "wheels.lock.json"
WHEEL_DIR = REPO / ".whl"
TRAVEL_LIMIT = 64 << 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
SLIM = {"nixl_cu13": ("nixl_ep_cu13/", "nixl_cu13.libs/ucx/libucx_perftest")}
"""Distribution -> member prefixes dropped from its wheel (never imported by the kit)."""
_TAG = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>.+)\.whl$")


def specs() -> list[tuple[str, str]]:
    out = []
    for line in SPECS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out.append((name.strip(), version.strip()))
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def build(dest: Path = WHEEL_DIR, python: str = sys.executable) -> dict:
    """Download every spec for cp312 manylinux x86_64 into a fresh `dest`; slim; write the lock."""
    tmp = Path(tempfile.mkdtemp(prefix="gpu-wheels-"))
    try:
        for name, version in specs():
            cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                   "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS), "-d", str(tmp),
                   f"{name}=={version}"]
            subprocess.run(cmd, check=True, timeout=900)
        entries = []
        for path in sorted(tmp.glob("*.whl")):
            source = _sha256(path)
            dist = _norm(_TAG.match(path.name)["name"])
            if dist in SLIM:
                slim(path, SLIM[dist])
            entries.append({"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path),
                            "source_sha256": source, "slimmed": dist in SLIM})
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lock = {"python": "cp312", "platform": "manylinux x86_64", "wheels": entries,
            "total_bytes": sum(e["bytes"] for e in entries)}
    LOCK.write_text(json.dumps(lock, indent=1) + "\n")
    return lock


def slim(path: Path, prefixes: tuple[str, ...]) -> int:
    """Rewrite the wheel at `path` without members under `prefixes` (RECORD updated); bytes saved."""
    before = path.stat().st_size
    out = path.with_suffix(".slim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename.startswith(prefixes):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not line.startswith(prefixes)).encode()
            dst.writestr(info, data, compress_type=info.compress_type)
    out.replace(path)
    return before - path.stat().st_size


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def lock() -> dict:
    return json.loads(LOCK.read_text())


def check(dest: Path = WHEEL_DIR) -> dict:
    """The built set against the specs and the lock: problems (empty = good) and sizes."""
    problems, want = [], {_norm(n): v for n, v in specs()}
    tracked = subprocess.run(["git", "ls-files", str(dest)], capture_output=True, text=True, cwd=REPO).stdout.split()
    if tracked:
        problems.append(f"{len(tracked)} files under {dest.name}/ are tracked by git: the wheels must stay out of "
                        "history (git rm -r --cached .whl)")
    locked = {e["file"]: e for e in lock()["wheels"]}
    locked_dists = {_norm(_TAG.match(f)["name"]) for f in locked}
    if locked_dists != set(want):
        problems.append(f"wheels.lock.json lists {sorted(locked_dists)}, wheels.txt {sorted(want)}: run make gpu-wheels")
    files = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if not files:
        return {"built": False, "problems": problems, "locked_bytes": lock()["total_bytes"],
                "note": f"{dest.name}/ not built here: `make gpu-wheels` downloads the locked set"}
    seen: dict[str, str] = {}
    for path in files:
        m = _TAG.match(path.name)
        if m is None:
            problems.append(f"{path.name}: not a wheel file name")
            continue
        dist = _norm(m["name"])
        if dist in seen:
            problems.append(f"two versions of {dist}: {seen[dist]} and {path.name} (pip would refuse the set)")
        seen[dist] = path.name
        if want.get(dist) != m["version"]:
            problems.append(f"{path.name}: not in wheels.txt (want {dist}=={want.get(dist)})")
        if not (m["py"] in ("py3", "cp312", "py2.py3") and m["abi"] in ("none", "cp312", "abi3")
                and (m["plat"] == "any" or (m["plat"].startswith("manylinux") and m["plat"].endswith("x86_64")))):
            problems.append(f"{path.name}: not installable on cp312 manylinux x86_64")
        entry = locked.get(path.name)
        if entry is None or entry["bytes"] != path.stat().st_size:
            problems.append(f"{path.name}: differs from wheels.lock.json")
    for dist in set(want) - set(seen):
        problems.append(f"{dist} missing from {dest.name}/")
    return {"built": True, "problems": problems, "bytes": sum(p.stat().st_size for p in files),
            "files": [p.name for p in files]}


def travel_bytes(carry: tuple[str, ...] = (".whl",)) -> dict:
    """What a device call sends: tracked + untracked-not-ignored files, plus `carry` (locked sizes
    stand in for a wheel set not built here)."""
    def listed(*args: str) -> list[str]:
        out = subprocess.run(["git", "ls-files", "-z", *args], capture_output=True, text=True, cwd=REPO, check=True)
        return [p for p in out.stdout.split("\0") if p]

    tree = 0
    for rel in {*listed(), *listed("--others", "--exclude-standard")}:
        path = REPO / rel
        if path.is_file() and not path.is_symlink():
            tree += path.stat().st_size
    carried = {}
    for rel in carry:
        root = REPO / rel
        files = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
        carried[rel] = sum(p.stat().st_size for p in files) if files else (
            lock()["total_bytes"] if rel == ".whl" else 0)
    total = tree + sum(carried.values())
    return {"tree_bytes": tree, "carried_bytes": carried, "total_bytes": total, "limit_bytes": TRAVEL_LIMIT,
            "fits": total <= TRAVEL_LIMIT, "margin_mib": round((TRAVEL_LIMIT - total) / 2**20, 1)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        result = build()
        print(json.dumps(result, indent=1))
        size = travel_bytes()
        print(f"wheel set {result['total_bytes'] / 2**20:.1f} MiB; a device call sends "
              f"{size['total_bytes'] / 2**20:.1f} MiB of {TRAVEL_LIMIT >> 20} MiB")
        return 0 if size["fits"] else 1
    if argv[:1] == ["check"]:
        result = {**check(), "travel": travel_bytes()}
        print(json.dumps(result, indent=1))
        return 0 if not result["problems"] and result["travel"]["fits"] else 1
    print(__doc__)
    return 2


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main(sys.argv[1:]))
