# SPDX-License-Identifier: Apache-2.0
"""Observability: OpenTelemetry tracing across processes, structured logs, a local trace receiver
and the `vllm-disagg trace` waterfall. Imports only stdlib and OpenTelemetry (it sits beside
`config` at the bottom of the layering: every other concept may use it). See README.md here."""
