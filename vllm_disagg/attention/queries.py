# SPDX-License-Identifier: Apache-2.0
"""What the KV connector's Lamina half asks an attention server over HTTP, in one place: its KV
receiver's address, the bytes of each prefill push that landed, and the blocks it retained.

The server side is `server.py`; the paths and their JSON are its public contract
(`docs/design/retain_api.md`), so no other module spells them.
"""

from __future__ import annotations

import json
import urllib.request

from vllm_disagg.attention.block_keys import KEY_SIZE
from vllm_disagg.errors import DisaggError, PeerLostError

HTTP_TIMEOUT_S = 5.0
MAX_IDS_PER_QUERY = 128


def get_json(server: str, path: str, timeout_s: float = HTTP_TIMEOUT_S, token: str | None = None,
             method: str = "GET") -> dict:
    """`GET` (or `method`) `http://server/path` as a JSON object; a server that does not answer is `PeerLostError`."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        req = urllib.request.Request(f"http://{server}{path}", headers=headers, method=method)
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            out = json.loads(resp.read())
    except (OSError, ValueError) as err:  # HTTPError (401, 404) is an OSError
        raise PeerLostError(f"attention server {server}{path}: {err}") from err
    if not isinstance(out, dict):
        raise PeerLostError(f"attention server {server}{path}: expected a JSON object")
    return out


def kv_address(server: str, timeout_s: float = HTTP_TIMEOUT_S) -> str:
    """The address of the server's KV receiver (prefill pushes land there), from `GET /health`."""
    return kv_receiver(server, timeout_s)[0]


def kv_receiver(server: str, timeout_s: float = HTTP_TIMEOUT_S) -> tuple[str, str]:
    """(address, transport kind) of the server's KV receiver, from `GET /health`."""
    info = get_json(server, "/health", timeout_s)
    if not info.get("kv_address"):
        raise DisaggError(f"attention server {server} accepts no prefill KV (start it with --kv-transport)")
    if info.get("kernel") != "cpu":
        raise DisaggError(f"attention server {server} runs kernel {info.get('kernel')!r}; prefill "
                          "pushes are written in vLLM's CPU layout")
    return str(info["kv_address"]), str(info.get("kv_transport", ""))


def kv_listen_address(server: str, timeout_s: float = HTTP_TIMEOUT_S) -> str:
    """Where the server's KV receiver listens (`kv_listen_address` in `GET /health`), which differs from
    `kv_address` when it advertises a proxy (a throttled link in chaos runs, a NAT)."""
    info = get_json(server, "/health", timeout_s)
    address = info.get("kv_listen_address") or info.get("kv_address")
    if not address:
        raise DisaggError(f"attention server {server} has no KV receiver (start it with --kv-transport)")
    return str(address)


def fence(server: str, transfer_ids: list[str], token: str, timeout_s: float = HTTP_TIMEOUT_S) -> bool:
    """`POST /kv/fence`: `server` drops every later byte of these pushes; True once none is mid-landing."""
    done = True
    for start in range(0, len(transfer_ids), MAX_IDS_PER_QUERY):
        chunk = transfer_ids[start:start + MAX_IDS_PER_QUERY]
        done &= all(get_json(server, "/kv/fence?ids=" + ",".join(chunk), timeout_s, token, method="POST").values())
    return done


def landed_bytes(server: str, transfer_ids: list[str], timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, int]:
    """Bytes of each push that landed on `server` so far (`GET /kv/landed`), for those with any."""
    out: dict[str, int] = {}
    for start in range(0, len(transfer_ids), MAX_IDS_PER_QUERY):
        chunk = transfer_ids[start:start + MAX_IDS_PER_QUERY]
        for transfer_id, num_bytes in get_json(server, "/kv/landed?ids=" + ",".join(chunk), timeout_s).items():
            if num_bytes > 0:
                out[transfer_id] = int(num_bytes)
    return out


def kv_checksums(server: str, block_ids: list[int], token: str, timeout_s: float = HTTP_TIMEOUT_S) -> str:
    """`GET /kv/checksums`: each layer's CRC32 over `block_ids` of `server`'s cache (its KV-head shard
    head-wise), as transport/checksum.py's `encode` writes them."""
    try:
        return str(get_json(server, "/kv/checksums?blocks=" + ",".join(map(str, block_ids)), timeout_s, token)["crc32"])
    except (PeerLostError, KeyError, TypeError) as err:
        raise DisaggError(f"attention server {server}: GET /kv/checksums: {err}") from err


def fetch_retained(server: str, token: str, timeout_s: float = HTTP_TIMEOUT_S) -> dict:
    """`GET /kv/retained` of one server, checked: block_size, keys (16-byte), ttl_s."""
    try:
        body = get_json(server, "/kv/retained", timeout_s, token)
        keys = {bytes.fromhex(k) for k in body["keys"]}
        out = {"block_size": int(body["block_size"]), "keys": keys, "ttl_s": float(body.get("ttl_s", 0.0))}
    except (PeerLostError, ValueError, KeyError, TypeError) as err:
        raise DisaggError(f"attention server {server}: GET /kv/retained: {err}") from err
    if any(len(k) != KEY_SIZE for k in keys):
        raise DisaggError(f"attention server {server}: /kv/retained holds keys that are not {KEY_SIZE} bytes")
    return out
