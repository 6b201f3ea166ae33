# SPDX-License-Identifier: Apache-2.0
"""Planner: the papers' analytic models and Splitwise's cluster simulator."""
