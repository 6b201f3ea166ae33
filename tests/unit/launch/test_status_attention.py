# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg status --state-file`: attention servers (in no router pool) are listed with their own health."""

from __future__ import annotations

import json

from vllm_disagg.launch.status import _from_state_file, render


def test_state_file_gives_the_router_url_and_only_the_attention_servers(tmp_path):
    state = {"endpoint": "http://127.0.0.1:8000", "instances": [
        {"name": "attention0", "role": "attention", "url": "http://127.0.0.1:8301", "pid": 11},
        {"name": "decode0", "role": "decode", "url": "http://127.0.0.1:8200", "pid": 12}]}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    router, extra = _from_state_file(str(path), None)
    assert router == "http://127.0.0.1:8000"
    assert extra == [{"name": "attention0", "role": "attention", "url": "http://127.0.0.1:8301", "pid": 11}]
    assert _from_state_file(str(path), "http://other:1")[0] == "http://other:1"


def test_attention_servers_render_sessions_and_queue_instead_of_requests():
    status = {"router": {"url": "http://r", "status": "ok", "healthy": True}, "unreachable_actors": [],
              "pools": {"attention": [{"url": "http://127.0.0.1:8301", "healthy": True, "actor": "attention0",
                                       "node": None, "starts": None, "disagg_attention_sessions": 1.0,
                                       "disagg_attention_queue_depth": 0.0}],
                        "decode": [{"url": "http://127.0.0.1:8200", "healthy": False, "pending_tokens": 3}]}}
    text = render(status)
    assert "attention (1/1 healthy)" in text and "sessions=1 queue=0" in text and "actor=" not in text
    assert "decode (0/1 healthy)" in text and "DOWN" in text
