"""One `swaserve serve` (tiny model, 2 workers, loopback Ray, no API key, a short write timeout)
for the session's end-to-end tests: test_openai_clients_e2e.py runs on it first,
test_openai_e2e.py last (its final test stops it with Ctrl-C)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
MODEL = "tiny"
WORKERS = 2
STARTUP_S = 300
# Short enough that the slow-reader test waits seconds, long enough that no other test's client
# (a busy machine, CPU hogs) ever leaves a write waiting that long.
WRITE_TIMEOUT_S = 5


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(port: int, config: Path) -> list[str]:
    # `python -m deploy serve` is `swaserve serve`; run through this interpreter so the server is this
    # checkout's code whatever `swaserve` script the environment's bin holds.
    return [sys.executable, "-m", "deploy", "serve", "--model", MODEL, "--workers", str(WORKERS),
            "--port", str(port), "--num-cpus", "2", "--config", str(config)]  # fmt: skip


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    config = log.with_name("serve.yaml")
    config.write_text(f"write_timeout_s: {WRITE_TIMEOUT_S}\n")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "SWASERVE_API_KEY": "",
           "SWASERVE_METRICS_KEY": ""}
    with log.open("w") as out:
        proc = subprocess.Popen(_command(port, config), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while "swaserve is ready" not in srv.text():
            assert proc.poll() is None, f"swaserve serve exited early:\n{srv.text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready after {STARTUP_S}s:\n{srv.text()[-4000:]}"
            time.sleep(0.5)  # waits on the server's startup log line
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
