# SPDX-License-Identifier: Apache-2.0
"""What the stream backends (`tcp/`, `shm/`) share: the KV receiver (`rx.py`) and sender (`tx.py`)
over stream connections, several streams a peer, chunks round-robin. tcp sends the block bytes
inline; shm memcpys them into the receiver's mapped memory first and sends only ids."""
