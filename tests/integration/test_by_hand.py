# SPDX-License-Identifier: Apache-2.0
"""The README's by-hand commands, run as written: shared secret, `vllm serve --plugin disagg` for P
and D, `vllm-disagg router`, and a request sent at once (it waits for admission: no 502, no sleep).

Only the fixed ports of the example are swapped for free ones (tests never use fixed ports). The
request must take the P/D path, and the router's /health must have said 503 while the instances
were starting.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_disagg.launch.local import free_ports

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"
EXAMPLE_PORTS = ("8100", "8200", "9100", "9200", "8000")


def by_hand_block() -> str:
    text = README.read_text()
    start = text.index("<!-- by-hand:")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def test_the_readmes_by_hand_commands_serve_a_pd_request(tmp_path):
    script = by_hand_block()
    ports = dict(zip(EXAMPLE_PORTS, map(str, free_ports(len(EXAMPLE_PORTS))), strict=True))
    script = re.sub(r"\b(8100|8200|9100|9200|8000)\b", lambda m: ports[m.group(1)], script)
    router = f"http://127.0.0.1:{ports['8000']}"
    # -w: the example's curl prints the answer; the test also wants its status and route header
    script = script.replace("curl -s ", "curl -s -D headers.txt -w '\\nHTTP %{http_code}\\n' ")
    (tmp_path / "by_hand.sh").write_text(script)
    out = tmp_path / "out.txt"
    with out.open("wb") as sink:  # the background servers keep writing here after bash exits
        proc = subprocess.Popen(["bash", "by_hand.sh"], cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_shell_env())
    try:
        early = _health(router, deadline_s=60)
        proc.wait(timeout=700)  # bash ends with the curl (the router admits it within 600 s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the three background servers (gone if they never started)
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(3)
    text = out.read_text(errors="replace")
    assert "HTTP 200" in text, text[-4000:]
    answer = json.loads(next(ln for ln in text.splitlines() if ln.startswith('{"id"')))
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 16
    assert "x-disagg-route: pd" in (tmp_path / "headers.txt").read_text().lower()
    assert early == 503  # /health said "not ready" while the instances were starting


def _shell_env() -> dict[str, str]:
    """The shell a user types in has the install's `vllm` and `vllm-disagg` on PATH; `make test` runs
    pytest as `.venv/bin/python -m pytest` without activating the venv, so put its bin first."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def _health(router: str, deadline_s: float) -> int | None:
    """The first status the router's /health gives once it listens."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            return urllib.request.urlopen(f"{router}/health", timeout=5).status
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            time.sleep(0.2)
    return None
