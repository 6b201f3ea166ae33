# SPDX-License-Identifier: Apache-2.0
"""Deprecated path: the overlap API is `vllm_disagg.overlap` (base layer, so the attention impl
and the KV connector can use it without importing nanoflow). This name is the same module."""

import sys

from vllm_disagg import overlap

sys.modules[__name__] = overlap
