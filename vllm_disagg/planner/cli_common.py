# SPDX-License-Identifier: Apache-2.0
"""What every `vllm-disagg plan` command shares: the model/catalog/profile flags and the guard
that turns a bad name, file or profile into one line instead of a traceback."""

from __future__ import annotations

import argparse
import functools
import sys

from vllm_disagg.planner.catalog import get_model
from vllm_disagg.planner.profile import load_profile


def guard(fn):
    """Bad names, files or profiles end with one clear line, not a traceback."""
    @functools.wraps(fn)
    def run(args) -> int:
        try:
            return fn(args)
        except (KeyError, ValueError, OSError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            print(f"vllm-disagg plan: error: {msg}", file=sys.stderr)
            return 2
    return run


def add_common_args(p: argparse.ArgumentParser, model_default: str) -> None:
    p.add_argument("--model", default=model_default, help="catalog model name")
    p.add_argument("--model-config", help="HF config.json instead of a catalog model")
    p.add_argument("--catalog", action="append", default=[],
                   help="extra catalog JSON (also $VLLM_DISAGG_PLANNER_CATALOG)")
    p.add_argument("--profile", help="measured profile JSON (schema in planner README)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", help="write the figure to this PNG")


def resolve_model(args):
    cats = tuple(args.catalog)
    return get_model(args.model_config, cats) if args.model_config else get_model(args.model, cats)


def profile_arg(args):
    return load_profile(args.profile) if args.profile else None
