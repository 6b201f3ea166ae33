# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_disagg.launch.ray ...` = `vllm-disagg up --backend ray ...`."""

import sys

from vllm_disagg.launch.cli import ray_main

sys.exit(ray_main())
