# SPDX-License-Identifier: Apache-2.0
"""P2: `vllm serve ... --plugin disagg --disagg-*` parses.

Upstream (vLLM 0.32): `vllm/engine/arg_utils.py:EngineArgs.add_cli_args` (staticmethod) and
`EngineArgs.from_cli_args` (classmethod).
Reason: vLLM has no hook for plugins to add `vllm serve` flags; unknown flags are fatal.
Delta: `add_cli_args` also adds the plugin's flag group; `from_cli_args` folds those flags into
`additional_config["disagg"]` first. A bad value exits with one line naming the flag.
No-op when `--plugin` is absent: the namespace is untouched and the flags default to None.
Removal plan: when vLLM grows a CLI-extension entry point, register the flags there.
"""

from __future__ import annotations

import sys

from vllm_disagg.patches.compat import version_ok

NAME = "cli_plugin_flag"


def apply() -> bool:
    if not version_ok(NAME):
        return False
    from vllm.engine.arg_utils import EngineArgs

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
    from vllm_disagg.cli.flags import add_disagg_flags

    if not any(a.dest == "plugin" for a in parser._actions):
        add_disagg_flags(parser)
    # ### PATCH END
    return parser


def _from_cli_args(cls, args):
    from vllm.engine.arg_utils import EngineArgs

    # ### PATCH START
    from vllm_disagg.cli.flags import merge_flags_into_namespace
    from vllm_disagg.config import DisaggConfigError

    try:
        merge_flags_into_namespace(args)
    except DisaggConfigError as err:
        sys.exit(f"error: {err}")
    # ### PATCH END
    return EngineArgs._vllm_disagg_original_from_cli_args(cls, args)
