# SPDX-License-Identifier: Apache-2.0
"""P2: `vllm serve ... --plugin disagg --disagg-*` parses.

Upstream (vLLM 0.32): `vllm/engine/arg_utils.py:EngineArgs.add_cli_args` (staticmethod) and
`EngineArgs.from_cli_args` (classmethod).
Reason: vLLM has no hook for plugins to add `vllm serve` flags; unknown flags are fatal.
Delta: `add_cli_args` also adds the plugin's flag group (`hooks.add_flags`); `from_cli_args` folds
those flags into `additional_config["disagg"]` first (`hooks.merge_flags`). A bad value exits with
one line naming the flag.
No-op when `--plugin` is absent: the namespace is untouched and the flags default to None.
Removal plan: when vLLM grows a CLI-extension entry point, register the flags there.
"""

from __future__ import annotations

import sys

from vllm_disagg.config import DisaggConfigError
from vllm_disagg.patches.compat import mark_skipped, version_ok

NAME = "cli_plugin_flag"
UPSTREAM = "vllm/engine/arg_utils.py:EngineArgs.add_cli_args"


def apply(hooks=None) -> bool:
    if not version_ok(NAME):
        return False
    from vllm.engine.arg_utils import EngineArgs

    if hooks is not None and hooks.add_flags is not None and hooks.merge_flags is not None:
        EngineArgs._vllm_disagg_add_flags = staticmethod(hooks.add_flags)
        EngineArgs._vllm_disagg_merge_flags = staticmethod(hooks.merge_flags)
    if getattr(EngineArgs, "_vllm_disagg_add_flags", None) is None:
        mark_skipped(NAME, "vllm_disagg.register() gave it no flag hooks")
        return False
    if hasattr(EngineArgs, "_vllm_disagg_original_add_cli_args"):
        return True  # idempotent
    EngineArgs._vllm_disagg_original_add_cli_args = EngineArgs.add_cli_args
    EngineArgs._vllm_disagg_original_from_cli_args = EngineArgs.from_cli_args.__func__
    EngineArgs.add_cli_args = staticmethod(_add_cli_args)
    EngineArgs.from_cli_args = classmethod(_from_cli_args)
    return True


def _add_cli_args(parser):
    from vllm.engine.arg_utils import EngineArgs

    parser = EngineArgs._vllm_disagg_original_add_cli_args(parser)
    # ### PATCH START
    if not any(a.dest == "plugin" for a in parser._actions):
        EngineArgs._vllm_disagg_add_flags(parser)
    # ### PATCH END
    return parser


def _from_cli_args(cls, args):
    from vllm.engine.arg_utils import EngineArgs

    # ### PATCH START

    try:
        EngineArgs._vllm_disagg_merge_flags(args)
    except DisaggConfigError as err:
        sys.exit(f"error: {err}")
    # ### PATCH END
    return EngineArgs._vllm_disagg_original_from_cli_args(cls, args)
