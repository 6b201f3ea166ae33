# SPDX-License-Identifier: Apache-2.0
"""Replay of a request whose instance failed: the continuation body and the stitched client stream.

Pure logic, no I/O (the proxy drives it). A streamed request goes upstream with `return_token_ids`
so the router learns the prompt's token ids (first chunk) and every generated id. When the instance
dies mid-stream, the next attempt is a *continuation*: `/v1/completions` on `prompt ids + generated
ids` with `max_tokens`/`min_tokens` reduced by what was generated. Its chunks are rewritten so the
client sees one uninterrupted completion: the first attempt's `id`/`created`, no second
`prompt_token_ids`, usage counted against the original prompt, chat chunks for a chat request, and
no `token_ids` unless the client asked for them. Non-streamed requests carry no partial output, so
they are re-sent whole (`generated == []`). More: README.md, "replay.py".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"[DONE]"
# Completion fields that must not reach a continuation (they refer to the original prompt).
_NOT_CONTINUED = ("prompt_logprobs", "echo", "suffix", "truncate_prompt_tokens", "kv_transfer_params",
                  "prompt_embeds")
# Chat fields a completions continuation understands the same way.
_CHAT_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                  "logit_bias", "allowed_token_ids", "bad_words", "stream_options", "user", "priority",
                  "cache_salt", "request_id")
# Chat features whose output a completions continuation cannot reproduce.
_CHAT_NOT_CONTINUABLE = ("tools", "functions", "response_format", "structured_outputs", "guided_json",
                         "guided_regex", "guided_choice", "guided_grammar", "logprobs", "top_logprobs")


class UpstreamFailed(Exception):
    """The upstream answer cannot be relayed (error event, a [DONE] before the finish, bad JSON)."""


def replayable(body: dict[str, Any]) -> bool:
    """One prompt, one choice, no echo: the only shape whose output can be stitched."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return False  # a batch of prompts
    return (body.get("n") or 1) == 1 and (body.get("best_of") or 1) == 1 and not body.get("echo")


def can_continue(body: dict[str, Any], chat: bool) -> bool:
    """Whether a continuation after partial output reproduces what the request asked for."""
    return not (chat and any(body.get(k) for k in _CHAT_NOT_CONTINUABLE))


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The first attempt of a streamed request: the client's body plus `return_token_ids`."""
    return {**body, "return_token_ids": True} if body.get("stream") else body


def max_output_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """The request's output budget; None for a chat request without one (vLLM fills the context)."""
    if chat:
        limit = body.get("max_completion_tokens")
        return limit if limit is not None else body.get("max_tokens")
    return 16 if body.get("max_tokens") is None else body["max_tokens"]  # OpenAI's completion default


def continuation_body(body: dict[str, Any], chat: bool, prompt_ids: list[int], generated: list[int],
                      max_model_len: int | None = None) -> dict[str, Any]:
    """A `/v1/completions` body that goes on from `generated` (streamed, with token ids).

    `max_model_len` is needed only for a chat request without an output limit."""
    done = len(generated)
    limit = max_output_tokens(body, chat)
    if limit is None:
        if max_model_len is None:
            raise ValueError("a chat request without max_tokens needs the model's max_model_len")
        limit = max_model_len - len(prompt_ids)
    if chat:
        out = {k: body[k] for k in _CHAT_SAMPLING if k in body}
    else:
        out = {k: v for k, v in body.items() if k not in _NOT_CONTINUED}
    out.update(prompt=list(prompt_ids) + list(generated), max_tokens=max(1, limit - done), stream=True,
               return_token_ids=True)
    out.pop("max_completion_tokens", None)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, int(body["min_tokens"]) - done)
    return out


class SSEParser:
    """Splits a byte stream into SSE `data:` payloads, whatever the chunk boundaries."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for event in events:
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
        return out


@dataclass
class Stitcher:
    """State of one streamed request across attempts: what the client has seen, what to send next."""

    body: dict[str, Any]
    chat: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    attempts: int = 0
    _offset: int = 0  # tokens generated before the current attempt
    _continuing: bool = False  # the current attempt is a completions continuation
    _seen_first: bool = False  # the client got a first chunk (id, role, prompt ids)
    _id: str | None = None
    _created: int | None = None

    @property
    def client_wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    def next_request(self, endpoint: str, max_model_len: int | None = None) -> tuple[dict[str, Any], str]:
        """Body and endpoint of the next attempt: the original (nothing generated yet) or a continuation."""
        self.attempts += 1
        self._offset = len(self.generated)
        self._continuing = bool(self.generated) and self.prompt_ids is not None
        if not self._continuing:
            return upstream_body(self.body), endpoint
        return (continuation_body(self.body, self.chat, self.prompt_ids, self.generated, max_model_len),
                "completions")

    def needs_max_model_len(self) -> bool:
        return self.chat and bool(self.generated) and max_output_tokens(self.body, True) is None

    def continuable(self) -> bool:
        return not self.generated or (self.prompt_ids is not None and can_continue(self.body, self.chat))

    def spent(self) -> bool:
        """Every token of the budget reached the client, but no finish chunk did."""
        left = self.remaining()
        return bool(self.generated) and not self.finished and left is not None and left <= 0

    def remaining(self) -> int | None:
        limit = max_output_tokens(self.body, self.chat)
        return None if limit is None else limit - len(self.generated)

    # ----------------------------------------------------------- events
    def on_event(self, data: bytes) -> bytes | None:
        """One upstream payload -> the SSE bytes for the client (None: nothing to send)."""
        if data.strip() == DONE:
            if not self.finished:
                raise UpstreamFailed("the stream ended before its last token")
            return None
        try:
            event = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UpstreamFailed(f"upstream sent a chunk that is not JSON: {data[:120]!r}") from exc
        if not isinstance(event, dict):
            raise UpstreamFailed(f"upstream sent a chunk that is not an object: {data[:120]!r}")
        if "error" in event:
            raise UpstreamFailed(f"upstream error event: {json.dumps(event['error'])[:300]}")
        self._record(event)
        event = self._rewrite(event)
        if event is None:
            return None
        self._seen_first = True
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def finish_chunk(self) -> bytes:
        """A closing chunk when the budget ran out exactly at a failure (no upstream finish seen)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        event = {"id": self._id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self._created, "model": self.body.get("model"), "choices": [choice]}
        self.finished = True
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def _record(self, event: dict[str, Any]) -> None:
        if self._id is None:
            self._id, self._created = event.get("id"), event.get("created")
        if self.prompt_ids is None and not self._continuing:
            ids = event.get("prompt_token_ids")  # chat: top level of the first chunk
            for choice in event.get("choices") or []:
                ids = choice.get("prompt_token_ids") or ids  # completions: in the first choice
            if ids is not None:
                self.prompt_ids = list(ids)
        for choice in event.get("choices") or []:
            self.generated += choice.get("token_ids") or []
            if choice.get("finish_reason") is not None:
                self.finished = True

    def _rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        if self.attempts > 1:
            event["id"], event["created"] = self._id, self._created
        if self._seen_first:  # the client has the prompt's ids (and the chat role) already
            event.pop("prompt_token_ids", None)
        if self._continuing and self.chat:
            event = self._as_chat(event)
        choices = []
        for choice in event.get("choices") or []:
            choice = dict(choice)
            if self._seen_first:
                choice.pop("prompt_token_ids", None)
                if isinstance(choice.get("delta"), dict) and "role" in choice["delta"]:
                    choice["delta"] = {k: v for k, v in choice["delta"].items() if k != "role"}
                    if not any(choice["delta"].values()) and not choice.get("token_ids") \
                            and choice.get("finish_reason") is None:
                        continue  # a repeated role-only chunk
            if not self.client_wants_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            choices.append(choice)
        if not choices and event.get("choices"):
            return None
        event["choices"] = choices
        if not self.client_wants_ids:
            event.pop("prompt_token_ids", None)
        if self._continuing and isinstance(event.get("usage"), dict):
            event["usage"] = _shift_usage(event["usage"], self._offset)
        return event

    def _as_chat(self, event: dict[str, Any]) -> dict[str, Any]:
        """A completions chunk of the continuation as a chat completion chunk."""
        choices = []
        for c in event.get("choices") or []:
            choice = {"index": 0, "delta": {"content": c.get("text") or ""}, "logprobs": None,
                      "finish_reason": c.get("finish_reason")}
            if c.get("stop_reason") is not None:
                choice["stop_reason"] = c["stop_reason"]
            if "token_ids" in c:
                choice["token_ids"] = c["token_ids"]
            choices.append(choice)
        out = {"id": self._id, "object": "chat.completion.chunk", "created": self._created,
               "model": event.get("model"), "choices": choices}
        if "usage" in event:
            out["usage"] = event["usage"]
        return out


def _shift_usage(usage: dict[str, Any], offset: int) -> dict[str, Any]:
    """Usage of a continuation, counted against the original prompt."""
    usage = dict(usage)
    if isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= offset
    if isinstance(usage.get("completion_tokens"), int):
        usage["completion_tokens"] += offset
    usage.pop("prompt_tokens_details", None)
    return usage
