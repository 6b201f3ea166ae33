# SPDX-License-Identifier: Apache-2.0
"""A kill's window ends when a new process of its instance serves again (`back_after_s`), measured with
real processes: a killed server group and its replacement answering /health on a real socket."""

from __future__ import annotations

import random
import subprocess
import sys
import time

from vllm_disagg.launch.local import free_ports
from vllm_disagg.testing.chaos.faults import FaultInjector

_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Restarting:
    """The injector's view of a deployment whose one decode instance its launcher restarts on the same
    port (as the local launcher does); `restart()` starts the new process."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.procs = [self._spawn()]

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _SERVER, str(self.port)], start_new_session=True)

    def restart(self) -> None:
        self.procs.append(self._spawn())

    def instances(self) -> list[dict]:
        return [{"name": "decode0", "role": "decode", "pid": self.procs[-1].pid, "url": f"http://127.0.0.1:{self.port}"}]

    def pick(self, role, rng):
        return self.instances()[0]


def test_a_killed_instance_is_back_once_a_new_process_answers_health():
    deployment = _Restarting(free_ports(1)[0])
    try:
        time.sleep(1.0)  # the first incarnation serves: it must not count as back
        fault = FaultInjector(deployment, random.Random(0), log=lambda _: None).kill("decode")
        assert deployment.procs[0].wait(10) is not None
        time.sleep(2.5)
        assert "back_after_s" not in fault.detail  # nothing serves yet
        deployment.restart()
        deadline = time.monotonic() + 15
        while "back_after_s" not in fault.detail and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 2.5 <= fault.detail["back_after_s"] <= 10
    finally:
        for proc in deployment.procs:
            proc.kill()
            proc.wait()
