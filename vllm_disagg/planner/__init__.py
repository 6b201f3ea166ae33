# SPDX-License-Identifier: Apache-2.0
"""Planner: the papers' analytic models and Splitwise's cluster simulator.

Pure Python (numpy); no vLLM import. See README.md for the reading path.
"""

from vllm_disagg.planner.catalog import HardwareSpec, ModelSpec, get_hardware, get_model
from vllm_disagg.planner.nanoflow import Workload, op_costs, optimal_throughput
from vllm_disagg.planner.profile import Profile, load_profile

__all__ = [
    "HardwareSpec",
    "ModelSpec",
    "Profile",
    "Workload",
    "get_hardware",
    "get_model",
    "load_profile",
    "op_costs",
    "optimal_throughput",
]
