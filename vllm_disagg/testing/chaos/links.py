# SPDX-License-Identifier: Apache-2.0
"""The KV links a chaos campaign can throttle (`slow_link`) or corrupt (`corrupt_link`): a loopback proxy
(`testing/throttle.py`) that the receiving side advertises in place of its own receiver, so the prefill
instance's pushes cross it.

- P/D: the decode instance's receiver (`up --disagg-kv-advertise`), one link.
- Lamina: each attention server's receiver (`up --attention-kv-advertise`), one link per server: that is
  where prefill pushes land; the model worker verifies them (`--disagg-kv-verify on`).

The proxies start once `up` is healthy, from the listening addresses the instances report; a restarted
instance listens on the same fixed port, so its proxy stays valid.
"""

from __future__ import annotations

import random

from vllm_disagg.attention.queries import kv_listen_address
from vllm_disagg.testing.throttle import ThrottledProxy

__all__ = ["KVLinks"]


class KVLinks:
    def __init__(self, num_attention: int, free_port) -> None:
        self.num_attention = num_attention
        self.ports = [free_port() for _ in range(max(1, num_attention))]
        self.proxies: dict[str, ThrottledProxy] = {}
        """Receiving instance's name (the decode instance, or each attention server) -> its link."""

    def up_args(self) -> list[str]:
        """The flags that make `up`'s receivers advertise the proxies' ports."""
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        if self.num_attention:
            return ["--attention-kv-advertise", ",".join(addresses)]
        return ["--disagg-kv-advertise", addresses[0]]

    def open(self, instances: list[dict]) -> None:
        """One proxy per receiver, to the address it listens on (from `up`'s state, or a server's /health)."""
        if self.num_attention:
            servers = [i for i in instances if i["role"] == "attention"]
            for inst, port in zip(servers, self.ports, strict=True):
                self.proxies[inst["name"]] = ThrottledProxy(_listen_address(inst), None, port=port)
        else:
            (decode,) = [i for i in instances if i["role"] == "decode"]
            self.proxies[decode["name"]] = ThrottledProxy(decode["kv"], None, port=self.ports[0])

    def pick(self, rng: random.Random) -> tuple[str, ThrottledProxy] | tuple[None, None]:
        """A link at random: (receiving instance's name, its proxy), or (None, None) without links."""
        if not self.proxies:
            return None, None
        name = rng.choice(sorted(self.proxies))
        return name, self.proxies[name]

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()
        self.proxies.clear()


def _listen_address(server: dict) -> str:
    """Where an attention server's KV receiver listens (behind the proxy this module puts in front of it)."""
    return kv_listen_address(server["url"].removeprefix("http://"), timeout_s=10.0)
