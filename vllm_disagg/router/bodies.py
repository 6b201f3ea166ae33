# SPDX-License-Identifier: Apache-2.0
"""Request bodies of the push protocol (pd_protocol.md) and the token estimates JSQ routes on.

Pure functions, no I/O: what P gets (`max_tokens=1`, non-streaming, `do_remote_decode`), what D gets
(the client's body plus `do_remote_prefill` and P's KV side-channel address), and how many prompt
and output tokens a request will cost.
"""

from __future__ import annotations

import uuid
from typing import Any

# OpenAI's default when a completion request omits max_tokens.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Router-side estimate when a chat request omits it (vLLM fills to the context length).
DEFAULT_CHAT_MAX_TOKENS = 256
# Byte-level BPE tokenizers average ~4 bytes per token on English text and code.
_BYTES_PER_TOKEN = 4
# Fields that only make sense for the client's own (D) request.
_DECODE_ONLY_FIELDS = ("stream_options", "min_tokens", "n", "best_of", "logprobs", "top_logprobs",
                       "echo", "stop", "stop_token_ids", "ignore_eos")


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def prefill_body(body: dict[str, Any], transfer_id: str, chat: bool) -> dict[str, Any]:
    """P's copy: generate one token, no stream, and push the KV to the decode side."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY_FIELDS}
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


# vLLM's own P/D request flow (NixlConnector pull/push, and the connectors that share its protocol): P
# runs first and answers with the kv_transfer_params D needs; D gets them with the client's request.
VLLM_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


def vllm_prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """P's copy in vLLM's flow: one token, no stream, and keep the KV for D to fetch."""
    out = prefill_body(body, "", chat)
    out["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    return out


def vllm_decode_body(body: dict[str, Any], prefill_answer: Any) -> dict[str, Any] | None:
    """D's copy in vLLM's flow: the client's request plus the kv_transfer_params P answered with;
    None when P's answer carries none (D then has to compute the prompt itself)."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    return {**body, "kv_transfer_params": params}


def decode_body(
    body: dict[str, Any], transfer_id: str, kv_host: str, kv_port: int, push_timeout_s: float | None
) -> dict[str, Any]:
    """D's copy: the client's request unchanged, plus where the KV comes from."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": kv_host,
        "remote_port": kv_port,
    }
    if push_timeout_s is not None:
        params["push_timeout_s"] = push_timeout_s
    return {**body, "kv_transfer_params": params}


def plain_body(body: dict[str, Any]) -> dict[str, Any]:
    """A whole request for one instance; a client-supplied kv_transfer_params is not forwarded."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def estimate_prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """Prompt length for JSQ: exact for token-id prompts, ~bytes/4 for text (no tokenizer here)."""
    if chat:
        return max(1, sum(_text_tokens(m.get("content")) + 4 for m in body.get("messages") or []))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):  # a batch of prompts
        return max(1, sum(estimate_prompt_tokens({"prompt": p}, chat=False) for p in prompt))
    return max(1, _text_tokens(prompt))


def expected_output_tokens(body: dict[str, Any], chat: bool) -> int:
    limit = body.get("max_completion_tokens") if chat else None
    limit = limit if limit is not None else body.get("max_tokens")
    if limit is None:
        limit = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    n = body.get("n") or 1
    return max(1, int(limit)) * max(1, int(n))


def _text_tokens(content: Any) -> int:
    if isinstance(content, str):
        return -(-len(content.encode()) // _BYTES_PER_TOKEN)
    if isinstance(content, list):  # OpenAI content parts
        return sum(_text_tokens(p.get("text")) for p in content if isinstance(p, dict))
    return 0


def is_batch_prompt(body: dict[str, Any]) -> bool:
    """`prompt` as a list of prompts (strings or token lists): several requests in one."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 0 and not all(isinstance(t, int) for t in prompt)
