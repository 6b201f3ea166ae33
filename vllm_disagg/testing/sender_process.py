# SPDX-License-Identifier: Apache-2.0
"""A prefill-side PushSender alone in a process of its own, for tests that kill or freeze P (SIGKILL,
SIGSTOP) while the decode side in the test's process waits on it.

    python -m vllm_disagg.testing.sender_process JSON   -> prints the sender's address, then sleeps
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from vllm_disagg.kv.handshake import HandshakeInfo


def start_sender_process(info: HandshakeInfo, token: str, layer_shape: tuple[int, ...], push_timeout_s: float,
                         timeout_s: float | None = None) -> tuple[subprocess.Popen, str]:
    """Start the process; returns it and the address its sender listens on."""
    spec = {"info": info.__dict__, "token": token, "layer_shape": list(layer_shape),
            "push_timeout_s": push_timeout_s, "timeout_s": timeout_s}
    proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "VLLM_DISAGG_AUTH_TOKEN": token})
    address = proc.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"sender process exited with {proc.poll()}")
    return proc, address


def main() -> None:
    import torch

    from vllm_disagg.config import KVTransferSection
    from vllm_disagg.kv.push_sender import PushSender
    from vllm_disagg.kv.stats import DisaggKVConnectorStats
    from vllm_disagg.transport import TransportOptions, get_transport

    spec = json.loads(sys.argv[1])
    info = HandshakeInfo(**spec["info"])
    options = {"auth_token": spec["token"]} | ({"timeout_s": spec["timeout_s"]} if spec["timeout_s"] else {})
    transport = lambda: get_transport("tcp", TransportOptions(**options))  # noqa: E731
    layers = [torch.zeros(spec["layer_shape"]) for _ in range(info.num_layers)]
    sender = PushSender(transport(), transport(), info, spec["token"], layers,
                        KVTransferSection(push_timeout_s=spec["push_timeout_s"]),
                        (DisaggKVConnectorStats(), threading.Lock()))
    print(sender.address, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
