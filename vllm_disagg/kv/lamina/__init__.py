# SPDX-License-Identifier: Apache-2.0
"""The `DisaggConnector`'s Lamina halves, for a model worker whose KV lives on attention servers.

`reuse.py`: a restarted model worker restores the blocks its servers retained (scheduler half
`DisaggReuseScheduler`, worker half `DisaggReuseWorker`). `targets.py`: a prefill push lands
straight in the servers' blocks (`AttnPushReceiver`). Both talk to the servers only through the
attention package's public API (`attention.backend.current_client()`, `attention.queries`).
"""
