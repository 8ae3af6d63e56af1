"""The two servers `swaserve bench vllm-compare` runs, one at a time, and their processes.

Each server is started in its own session (so the harness can stop exactly what it started:
the process group of the PID it got), waits for `/health` to answer 200, and is stopped with
SIGTERM (swaserve's `serve` shuts Serve and Ray down on it; vLLM's API server stops its engine
processes), then SIGKILL to its group if it has not exited in time.

Both get one compute thread. vLLM's CPU build decides its OpenMP threads itself
(`VLLM_CPU_OMP_THREADS_BIND`): "auto" binds one OpenMP thread per core left after reserving one
core for its API/engine processes; we set "nobind" and `OMP_NUM_THREADS=1` so its compute
thread, like swaserve's replica (Ray sets `OMP_NUM_THREADS` to the replica's whole CPUs, 1), is
not pinned to a core another job on a shared machine may be using. `VLLM_CPU_KVCACHE_SPACE=1`
(GiB) holds ~137 K tokens of this model's KV, more than any workload here needs, instead of
vLLM's default 4 GiB.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.compare.procs import descendants, read_proc

REPO = Path(__file__).resolve().parents[2]
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
SWASERVE_ENV = {"OMP_NUM_THREADS": "1", "SWASERVE_API_KEY": ""}


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: its command line, the environment on top of ours, its URL."""

    name: str  # "vllm" | "swaserve"
    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 8000
    keep_pythonpath: bool = True  # vLLM's venv must not see this checkout's packages
    health_path: str = "/health"  # answers 200 once the server takes requests

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def shell_line(self) -> str:
        """The command as one would type it (environment first), for the report."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {' '.join(self.command)}".strip()


def vllm_spec(model_dir: Path, port: int, vllm: Path) -> ServerSpec:
    command = (
        str(vllm), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--seed", "0",
    )  # fmt: skip
    return ServerSpec("vllm", command, dict(VLLM_ENV), port, keep_pythonpath=False)


def swaserve_spec(model_dir: Path, port: int) -> ServerSpec:
    # `python -m deploy` runs this checkout's code (the `swaserve` script may be another's).
    command = (
        sys.executable, "-m", "deploy", "serve", "--model", str(model_dir), "--workers", "1",
        "--host", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
    )  # fmt: skip
    return ServerSpec("swaserve", command, dict(SWASERVE_ENV), port)


@dataclass
class RunningServer:
    spec: ServerSpec
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def start_server(spec: ServerSpec, log: Path, timeout_s: float = 900.0) -> RunningServer:
    """Start `spec` and wait until `/health` answers 200.

    Raises:
        RuntimeError: the server exited or was not healthy within `timeout_s` (it is stopped).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    _wait_port_free(spec.port, timeout_s)
    env = {**os.environ, **spec.env}
    if not spec.keep_pythonpath:
        env.pop("PYTHONPATH", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            spec.command, cwd=REPO, env=env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    server = RunningServer(spec, proc, log)
    deadline = time.monotonic() + timeout_s
    while not _healthy(spec.url + spec.health_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            state = f"exited ({proc.returncode})" if proc.returncode is not None else "not healthy"
            raise RuntimeError(f"{spec.name} {state}; log {log}:\n{server.log_tail()}")
        time.sleep(1.0)
    return server


def stop_server(server: RunningServer, grace_s: float = 120.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL whatever is left of its process group and of
    the processes below it.

    NOTE: Ray starts its actors' worker processes in process groups of their own, so the group
    alone misses a replica (and vLLM's engine processes below it) that outlives a Ray cut short:
    every descendant is listed before the SIGTERM (once orphaned they can no longer be found by
    parentage) and killed afterwards if it still runs under the same title.
    """
    below = [p for p in descendants(server.pid) if p.pid != server.pid]
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)  # the group of the session we started
    except (ProcessLookupError, PermissionError):
        pass
    server.proc.wait(30)
    for p in below:
        now = read_proc(p.pid)
        if now is not None and now.title == p.title:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_port_free(port: int, timeout_s: float) -> None:
    """The previous server's processes (Ray's HTTP proxy outlives `swaserve serve` by a few
    seconds) may still hold the port: wait until it can be bound."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
            try:
                sock.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"port {port} still in use after {timeout_s:.0f}s") from None
        time.sleep(1.0)  # waits on the old listener exiting


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback
            return bool(r.status == 200)
    except OSError:
        return False
