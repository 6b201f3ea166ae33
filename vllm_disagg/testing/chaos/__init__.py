# SPDX-License-Identifier: Apache-2.0
"""The chaos campaign (issue 18): workload, clients, faults, leak checks, and the campaign itself."""
