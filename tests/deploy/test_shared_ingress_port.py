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

# A grace that bounds a hang, not a timing: the drain test's long streams must finish inside it on
# a busy machine (the default 60 s did not once under CI's CPU hogs on a slow host).
CONFIG = "model: tiny\ningress_replicas: 2\ngraceful_shutdown_timeout_s: 600\n"
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



def _server_owner(conn: http.client.HTTPConnection, port: int, pids: list[int]) -> int | None:
    """The ingress process holding the server side of an open connection (None if it is not
    found: not accepted yet, or closed)."""
    local = conn.sock.getsockname()[1]
    inodes = [i for lp, rp, state, i in _tcp_sockets() if lp == port and rp == local and state == ESTABLISHED]
    return _owner(inodes[0], pids) if inodes else None


class _Stream:
    """A long streamed completion on its own connection, in flight once its first event came."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        body = {"model": "tiny", "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        assert self.resp.readline().startswith(b"data: ")  # the first token's event
        self.last = b""

    def read_to_end(self) -> None:
        for line in self.resp:
            if line.startswith(b"data: "):
                self.last = line.strip()


def test_sigterm_drains_every_ingress_replica(server: Server) -> None:
    """With a long stream in flight on each ingress replica, SIGTERM closes both: /health on
    fresh connections answers the drain's 503 from each replica, and both streams finish whole
    before the server exits 0. (Runs last: it stops the module's server.)"""
    import signal
    import threading

    pids = role_pids(server.proc.pid).get("ingress", [])
    port, streams = _port(server), dict[int, _Stream]()
    deadline = time.monotonic() + 180  # a bound on a hang, not a timing
    while set(streams) != set(pids):
        assert time.monotonic() < deadline, f"streams held by {set(streams)} of {pids}"
        s = _Stream(port)
        owner = _server_owner(s.conn, port, pids)
        if owner is None or owner in streams:
            s.conn.close()  # a second stream on that replica: cancelled
        else:
            streams[owner] = s
    readers = [threading.Thread(target=s.read_to_end) for s in streams.values()]
    for t in readers:
        t.start()
    server.proc.send_signal(signal.SIGTERM)
    drained: set[int] = set()  # replicas that answered /health with the drain's 503
    while drained != set(pids):
        assert time.monotonic() < deadline, f"only {drained} of {pids} closed after SIGTERM"
        assert all(t.is_alive() for t in readers), "a stream ended before every replica closed"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        owner = _server_owner(conn, port, pids)
        if resp.status == 503 and b"shutting down" in resp.read() and owner is not None:
            drained.add(owner)
        conn.close()
        time.sleep(0.05)  # waits on the close reaching every replica
    for t, s in zip(readers, streams.values(), strict=True):
        t.join(300)
        assert s.last == b"data: [DONE]", s.last
    assert server.proc.wait(120) == 0, server.text()[-3000:]
    assert "in-flight requests finished" in server.text()
