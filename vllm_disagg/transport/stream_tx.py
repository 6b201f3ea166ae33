# SPDX-License-Identifier: Apache-2.0
"""Deprecated path: `vllm_disagg.transport.stream.tx` (this name is the same module)."""

import sys

from vllm_disagg.transport.stream import tx

sys.modules[__name__] = tx
