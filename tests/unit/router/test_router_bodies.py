# SPDX-License-Identifier: Apache-2.0
"""Push-protocol request bodies and the token estimates JSQ routes on (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_disagg.router import bodies
from vllm_disagg.router.config import RouterConfig


def test_prefill_body_generates_one_token_without_streaming_and_asks_for_a_push():
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 3, "n": 2}
    out = bodies.prefill_body(body, "tid", chat=False)
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out and "n" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "tid"}
    assert body["max_tokens"] == 50  # the client's body is not mutated


def test_decode_body_is_the_client_body_plus_where_the_kv_comes_from():
    body = {"prompt": "hi", "max_tokens": 5, "stream": True}
    out = bodies.decode_body(body, "tid", "127.0.0.1", 9100, push_timeout_s=2.5)
    assert {k: v for k, v in out.items() if k != "kv_transfer_params"} == body
    assert out["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": "tid",
                                         "remote_host": "127.0.0.1", "remote_port": 9100, "push_timeout_s": 2.5}
    assert "push_timeout_s" not in bodies.decode_body(body, "t", "h", 1, None)["kv_transfer_params"]


def test_plain_body_drops_a_client_supplied_kv_transfer_params():
    assert bodies.plain_body({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}) == {"prompt": "x"}


def test_token_id_prompts_are_counted_exactly_and_text_is_estimated():
    assert bodies.estimate_prompt_tokens({"prompt": list(range(1000))}, chat=False) == 1000
    assert bodies.estimate_prompt_tokens({"prompt": "abcd" * 100}, chat=False) == 100
    chat = {"messages": [{"role": "user", "content": "abcd" * 10}, {"role": "user", "content": [
        {"type": "text", "text": "abcd"}]}]}
    assert bodies.estimate_prompt_tokens(chat, chat=True) == 10 + 4 + 1 + 4


def test_batch_prompts_are_recognised_so_they_skip_the_push_path():
    assert bodies.is_batch_prompt({"prompt": ["a", "b"]})
    assert bodies.is_batch_prompt({"prompt": [[1, 2], [3]]})
    assert not bodies.is_batch_prompt({"prompt": [1, 2, 3]})
    assert not bodies.is_batch_prompt({"prompt": "a"})


def test_expected_output_tokens_follows_max_tokens_and_n_with_openai_defaults():
    assert bodies.expected_output_tokens({"max_tokens": 7, "n": 2}, chat=False) == 14
    assert bodies.expected_output_tokens({}, chat=False) == bodies.DEFAULT_COMPLETION_MAX_TOKENS
    assert bodies.expected_output_tokens({"max_completion_tokens": 3, "max_tokens": 9}, chat=True) == 3


@given(st.one_of(st.text(), st.lists(st.integers(0, 50000)), st.lists(st.text()), st.none(), st.integers()))
def test_estimates_never_fail_and_are_positive_for_any_prompt(prompt):
    assert bodies.estimate_prompt_tokens({"prompt": prompt}, chat=False) >= 1


def test_router_config_pairs_kv_addresses_with_prefill_instances():
    with pytest.raises(ValueError, match="--prefill-kv given 0 times for 1"):
        RouterConfig(prefill_urls=["http://a:1"], decode_urls=["http://b:2"])
    with pytest.raises(ValueError, match="no instances"):
        RouterConfig()
    with pytest.raises(ValueError, match="http://"):
        RouterConfig(mixed_urls=["127.0.0.1:8000"])
    cfg = RouterConfig(prefill_urls=["http://a:1"], prefill_kv=["a:9"], decode_urls=["http://b:2"])
    assert cfg.prefill_kv == ["a:9"]
