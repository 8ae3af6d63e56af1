"""`swaserve serve` as a child process for end-to-end tests: a free loopback port, loopback Ray
without auth or usage stats, no API key unless given; ready when its startup line is logged
(waited on with a deadline), stopped with SIGTERM (then SIGKILL to its process group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 300


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    tmp: Path, config: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> Iterator[Server]:
    """`python -m deploy serve --config <config> ARGS` (this checkout's code whatever `swaserve`
    script the environment's bin holds), logging to `tmp/serve.log`."""
    (tmp / "serve.yaml").write_text(config)
    port, log = free_port(), tmp / "serve.log"
    cmd = [sys.executable, "-m", "deploy", "serve", "--config", str(tmp / "serve.yaml"),
           "--port", str(port), "--num-cpus", "2", *args]  # fmt: skip
    full_env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                "SWASERVE_API_KEY": "", "SWASERVE_METRICS_KEY": "", **(env or {})}  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while "swaserve is ready" not in srv.text():
            assert proc.poll() is None, f"swaserve serve exited early:\n{srv.text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {STARTUP_S}s:\n{srv.text()[-3000:]}"
            time.sleep(0.5)  # waits on the server's startup log line
        yield srv
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL to its process group if it hangs.

    NOTE: not Ctrl-C: a test run started in the background of a shell inherits SIGINT ignored,
    which Python then leaves ignored, so the server never saw it and every e2e module waited out
    the 90 s below before the SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
