"""`swaserve serve` with two ingress replicas and no proxy: both bind the one port (SO_REUSEPORT,
`cluster.ray_private.direct_ingress_server`) and both answer on it (docs/design.md §4.2).

Which replica answered a connection is read from the kernel, not from the response: the server
side of each open connection is a socket one of the ingress processes holds (`/proc/<pid>/fd`
against `/proc/net/tcp`)."""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.compare.procs import role_pids
from tests.serve_process import Server, serve

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

CONFIG = "model: tiny\ningress_replicas: 2\n"
LISTEN, ESTABLISHED = "0A", "01"
CONNECTIONS = 8  # per round: each lands on either replica (a hash of its addresses)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("shared_ingress"), CONFIG) as srv:
        yield srv


def _port(srv: Server) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _tcp_sockets() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket of this network namespace."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, remote = int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16)
            rows.append((local, remote, f[3], int(f[9])))
    return rows


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:["):
            out.add(int(target[len("socket:[") : -1]))
    return out


def _owner(inode: int, pids: list[int]) -> int | None:
    return next((pid for pid in pids if inode in _socket_inodes(pid)), None)


def _answered_by(srv: Server, pids: list[int]) -> set[int]:
    """One round: `CONNECTIONS` keep-alive connections, a completion and /health on each; the
    ingress process holding each one's server side while it is open."""
    port, conns = _port(srv), []
    try:
        for i in range(CONNECTIONS):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            body = json.dumps({"model": "tiny", "prompt": f"hello {i}", "max_tokens": 2})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 2
            conn.request("GET", "/health")
            health = conn.getresponse()
            assert health.status == 200 and health.read() is not None
            conns.append(conn)
        clients = {c.sock.getsockname()[1] for c in conns}
        served = [inode for local, remote, state, inode in _tcp_sockets()
                  if local == port and remote in clients and state == ESTABLISHED]  # fmt: skip
        assert len(served) == CONNECTIONS, "every open connection has its server side"
        return {p for p in (_owner(i, pids) for i in served) if p is not None}
    finally:
        for c in conns:
            c.close()


def test_two_ingress_replicas_listen_on_the_port_and_both_answer(server: Server) -> None:
    """Both Ingress replicas hold a listening socket on the one port, and connections to it are
    answered by both (rounds of fresh connections until each replica has served one)."""
    pids = role_pids(server.proc.pid).get("ingress", [])
    assert len(pids) == 2, f"ingress processes: {pids}"
    port = _port(server)
    listening = [inode for local, _, state, inode in _tcp_sockets() if local == port and state == LISTEN]
    assert all(set(listening) & _socket_inodes(pid) for pid in pids), "each ingress listens on the port"
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while seen != set(pids):
        assert time.monotonic() < deadline, f"only {seen} of {pids} answered"
        seen |= _answered_by(server, pids)
    assert "ingress replicas will listen" in server.text()
