# SPDX-License-Identifier: Apache-2.0
"""Command-line entry points: the `vllm-disagg` console script and the `--plugin disagg` flags."""
