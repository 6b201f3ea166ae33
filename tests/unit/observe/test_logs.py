# SPDX-License-Identifier: Apache-2.0
"""Structured logs carry the request id and trace id, and `vllm-disagg logs` merges and filters them."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config

from vllm_disagg.launch import logs as logs_cli
from vllm_disagg.observe import logs


def _record(msg, *args, **extra):
    record = logging.LogRecord("vllm.x", logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_json_lines_take_ids_from_extra_the_bound_context_or_a_vllm_request_id_in_the_message():
    fmt = logs.JsonFormatter(service="vllm-disagg-decode0")
    line = json.loads(fmt.format(_record("push of %s failed", "x", request_id="r1", trace_id="t1")))
    assert (line["request_id"], line["trace_id"], line["service"], line["msg"]) == \
        ("r1", "t1", "vllm-disagg-decode0", "push of x failed")
    token = logs.bind("router-7", "ab" * 16)
    try:
        assert json.loads(fmt.format(_record("relaying")))["request_id"] == "router-7"
    finally:
        logs._CONTEXT.reset(token)
    logs.remember_trace("cmpl-abc123-0-deadbeef", "cd" * 16)
    line = json.loads(fmt.format(_record("Finished request cmpl-abc123-0.")))
    assert (line["request_id"], line["trace_id"]) == ("cmpl-abc123-0", "cd" * 16)
    assert "request_id" not in json.loads(fmt.format(_record("engine started")))


def test_text_lines_append_the_ids_when_known():
    assert logs.TextFormatter().format(_record("hi", request_id="r9")).endswith("hi [request_id=r9]")
    assert logs.TextFormatter().format(_record("hi")).endswith("hi")


def test_vllm_logging_config_is_a_valid_dict_config():
    config = logs.vllm_logging_config("json")
    logging.config.dictConfig({**config, "loggers": {"vd-test": config["loggers"]["vllm"]}})
    assert isinstance(logging.getLogger("vd-test").handlers[0].formatter, logs.JsonFormatter)


def test_logs_command_merges_files_by_time_and_filters_one_request(tmp_path, capsys):
    def line(ts, msg, **ids):
        return json.dumps({"ts": ts, "level": "INFO", "process": "p", "msg": msg, **ids}) + "\n"
    (tmp_path / "router.log").write_text(line("2026-01-01T00:00:01.000Z", "routed", request_id="r1") +
                                         line("2026-01-01T00:00:03.000Z", "done", request_id="r1"))
    (tmp_path / "decode0.log").write_text(line("2026-01-01T00:00:02.000Z", "decoding",
                                               request_id="cmpl-r1-0-ab12cd34", trace_id="t") +
                                          line("2026-01-01T00:00:02.500Z", "other", request_id="cmpl-r2-0") +
                                          "a plain text line\n")
    args = argparse.Namespace(log_dir=str(tmp_path), state_file=None, follow=False, request="r1", process=[],
                              json=False)
    assert logs_cli.run(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in out] == ["router", "decode0", "router"]
    assert "decoding  [request_id=cmpl-r1-0-ab12cd34 trace_id=t]" in out[1]
