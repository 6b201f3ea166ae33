# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg logs`: every process of a `vllm-disagg up` deployment in one stream.

    vllm-disagg logs --state-file s.json                  # all logs merged by time
    vllm-disagg logs --state-file s.json --follow         # and new lines as they come (tail -f)
    vllm-disagg logs --log-dir DIR --request ID           # one request's lines, from every process

`up` writes one file per process into its log dir (router.log, prefill0.log, decode0.log,
attention0.log, ...), as JSON lines with `request_id` and `trace_id` by default (`up --log-format`).
Each line is shown as `time level process: message [ids]`, prefixed with its file's name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("logs", help="show (and follow) the logs of every process of a deployment",
                              description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--state-file", default=None, help="state file of `vllm-disagg up --state-file` (has log_dir)")
    p.add_argument("--log-dir", default=None, help="the --log-dir of `vllm-disagg up`")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines (Ctrl-C stops)")
    p.add_argument("--request", default=None, metavar="ID",
                   help="only lines of this request id or trace id (substring match on text lines)")
    p.add_argument("--process", action="append", default=[], metavar="NAME",
                   help="only these files (router, prefill0, ...); repeat")
    p.add_argument("--json", action="store_true", help="print the JSON lines as they are")
    p.set_defaults(func=run)
    return p


def log_dir_of(args: argparse.Namespace) -> Path:
    if args.log_dir:
        return Path(args.log_dir)
    if not args.state_file:
        raise SystemExit("vllm-disagg logs: give --state-file F or --log-dir DIR")
    try:
        return Path(json.loads(Path(args.state_file).read_text())["log_dir"])
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"vllm-disagg logs: cannot read log_dir from {args.state_file}: {err!r}") from None


def parse(line: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "msg" in obj else None


def matches(line: str, obj: dict[str, Any] | None, wanted: str | None) -> bool:
    if wanted is None:
        return True
    if obj is not None:  # the router's id is inside vLLM's (cmpl-<id>-0-...)
        return wanted == obj.get("trace_id") or wanted in str(obj.get("request_id", ""))
    return wanted in line


def render(name: str, line: str, obj: dict[str, Any] | None, raw: bool) -> str:
    if obj is None or raw:
        return f"{name:<11} {line}"
    ids = " ".join(f"{k}={obj[k]}" for k in ("request_id", "trace_id") if obj.get(k))
    return (f"{name:<11} {obj.get('ts', '')} {obj.get('level', ''):<7} {obj.get('process', '')}: "
            f"{obj['msg']}{f'  [{ids}]' if ids else ''}")


class _File:
    def __init__(self, path: Path) -> None:
        self.path, self.name, self.offset, self.last_ts = path, path.stem, 0, ""

    def new_lines(self) -> list[tuple[str, str, dict | None]]:
        """(sort key, line, parsed) of every complete line written since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for raw in data[:end].decode(errors="replace").splitlines():
            obj = parse(raw)
            self.last_ts = str(obj.get("ts", self.last_ts)) if obj else self.last_ts  # text lines keep their place
            out.append((self.last_ts, raw, obj))
        return out


def run(args: argparse.Namespace) -> int:
    directory = log_dir_of(args)
    if not directory.is_dir():
        raise SystemExit(f"vllm-disagg logs: {directory} is not a directory")
    files: dict[Path, _File] = {}
    try:
        while True:
            for path in sorted(directory.glob("*.log")):
                if path not in files and (not args.process or path.stem in args.process):
                    files[path] = _File(path)
            batch = [(key, f.name, line, obj) for f in files.values() for key, line, obj in f.new_lines()]
            for _, name, line, obj in sorted(batch, key=lambda b: b[0]):
                if matches(line, obj, args.request):
                    print(render(name, line, obj, args.json), flush=True)
            if not args.follow:
                return 0
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `| head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
