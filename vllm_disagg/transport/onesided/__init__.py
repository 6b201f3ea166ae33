# SPDX-License-Identifier: Apache-2.0
"""What the one-sided backends (`rdma`, `mscclpp`) share: the receiver half (`inbox.py`), block-run
planning (`runs.py`), the notification slot (`notif.py`) and addressing memory (`memory.py`).
Pure python, so the soft-RoCE VM runs it with Debian's python; neither backend imports the other.
"""
