"""The index actor's traffic on plain TCP connections instead of an actor call each.

A Ray actor call costs the index actor ~420 µs of CPU for an empty method on the 2-core
development machine and a 150-page push ~760 µs, and about as much again on the worker replica
that makes it (`swaserve bench index-actor`); a worker replica pushes once per finished request,
and every push woke each router's long poll, another call. As frames on a socket each costs
each side tens of µs. So the index actor listens on one TCP port of its node's address (opened
by the first `event_endpoint` call, which answers (host, port, token, proof)). A connection's
first frame is a role byte and the token (which travelled over Ray's own call: the actor
unpickles a connection's frames only after it matched); frames are a 4-byte little-endian
length and a pickle.

- A *pusher* (a worker replica's `EventPublisher`) then sends one frame per push, (batch,
  stats); the actor answers each with one byte after it applied the batch, 1 when it wants a
  resync (`PushAck.resync_needed`). A stats sample with no event to go with it (a request
  that started) is a push too, with a `StatsRefresh` in the batch's place: answered 0.
- A *follower* (a router's `IndexSubscriber`) first reads the proof, a second secret of the
  same answer (so it unpickles nothing from a process that took the port after the actor's
  death), then sends its (epoch, cursor) and reads one frame per delta past it as the log
  grows, an empty frame each `HEARTBEAT_S` with nothing new.

Resyncs, the replica's periodic (registering) stats reports, removal and a decision's catch-up
pulls stay actor calls. A connection
that fails (the actor restarted: a new port and token; a network that blocks the port) ends:
the publisher resyncs (its push may or may not have been applied) and connects again at its
next push; the follower long-polls once and connects again; either uses actor calls for
`UNREACHABLE_S` when it could not connect.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("swaserve.cluster")

HEADER = 4  # bytes of a frame's length
MAX_TOKEN = 64  # bytes of the first frame
MAX_FRAME = 64 * 1024 * 1024  # a batch of a long prefill's pages is well under a MiB
CONNECT_TIMEOUT_S = 5.0
ACK_TIMEOUT_S = 60.0  # a push not answered within this: the connection is dropped
UNREACHABLE_S = 300.0  # a worker that could not connect uses actor calls for this long

HEARTBEAT_S = 1.0  # a follower with nothing new gets an empty frame this often
PUSHER, FOLLOWER = b"P", b"F"  # the first byte of a connection's first frame

Endpoint = tuple[str, int, str, str]  # host, port, token, the actor's proof to followers


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "little") + payload


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None at the end of the connection before them."""
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(conn: socket.socket, limit: int) -> bytes | None:
    head = _read_exactly(conn, HEADER)
    if head is None:
        return None
    n = int.from_bytes(head, "little")
    if n > limit:
        raise ValueError(f"a frame of {n} bytes (at most {limit})")
    return _read_exactly(conn, n)


class EventSocketServer:
    """The index actor's side: one listening socket, a thread per worker connection calling
    `push(batch, stats) -> resync_needed` for each frame (the actor's own lock orders them)."""

    def __init__(
        self, host: str, push: Callable[[Any, Any], bool], pull_wait: Callable[[Any, int, float], Any] | None = None
    ) -> None:
        self._push, self._pull_wait = push, pull_wait
        self.token, proof = secrets.token_hex(16), secrets.token_hex(16)
        self._proof = proof.encode("ascii")
        self._sock = socket.create_server((host, 0))
        self.endpoint: Endpoint = (host, int(self._sock.getsockname()[1]), self.token, proof)
        threading.Thread(target=self._accept, name="swaserve-event-socket", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="swaserve-event-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                hello = _read_frame(conn, MAX_TOKEN)
                role, token = (hello[:1], hello[1:]) if hello else (b"", b"")
                if not secrets.compare_digest(token, self.token.encode("ascii")) or role not in (PUSHER, FOLLOWER):
                    log.warning("event socket: a connection without the token was closed unread")
                    return
                if role == FOLLOWER:
                    self._follow(conn)
                    return
                while (payload := _read_frame(conn, MAX_FRAME)) is not None:
                    batch, stats = pickle.loads(payload)
                    conn.sendall(b"\x01" if self._push(batch, stats) else b"\x00")
            except Exception as e:  # noqa: BLE001 - the connection ends; the worker resyncs
                log.warning("event socket connection ended: %s", e)

    def _follow(self, conn: socket.socket) -> None:
        """A router's connection: its (epoch, cursor), then every delta past it as the log
        grows, and an empty frame each `HEARTBEAT_S` with nothing new, until it closes."""
        if self._pull_wait is None:
            return
        conn.sendall(_frame(self._proof))  # who answers is the actor the router asked
        start = _read_frame(conn, MAX_TOKEN)
        if start is None:
            return
        epoch, cursor = pickle.loads(start)
        while True:
            delta = self._pull_wait(epoch, cursor, HEARTBEAT_S)
            conn.sendall(_frame(b"" if delta is None else pickle.dumps(delta, protocol=pickle.HIGHEST_PROTOCOL)))
            if delta is not None:
                epoch, cursor = delta.epoch, delta.cursor

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept (Linux)
        except OSError:
            pass
        self._sock.close()


class EventSocketClient:
    """A worker replica's connection: one push at a time (its `EventPublisher` holds a lock)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, endpoint: Endpoint, timeout_s: float = CONNECT_TIMEOUT_S) -> EventSocketClient:
        """Raises `OSError` (or `TimeoutError`) when the actor cannot be reached."""
        reader, writer = await _open(endpoint, PUSHER, timeout_s)
        return cls(reader, writer)

    async def push(self, batch: Any, stats: Any, timeout_s: float = ACK_TIMEOUT_S) -> bool:
        """Send one push and wait for its answer: True when the actor asks for a resync.
        Raises `ConnectionError`, `TimeoutError` or `asyncio.IncompleteReadError` when the
        connection fails (then whether the actor applied the push is not known)."""
        if self._writer.transport.is_closing():
            raise ConnectionResetError("the event socket is closed")
        self._writer.write(_frame(pickle.dumps((batch, stats), protocol=pickle.HIGHEST_PROTOCOL)))
        async with asyncio.timeout(timeout_s):
            await self._writer.drain()
            answer = await self._reader.readexactly(1)
        return answer == b"\x01"

    def close(self) -> None:
        self._writer.transport.abort()


async def _open(
    endpoint: Endpoint, role: bytes, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port, token, _ = endpoint
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.write(_frame(role + token.encode("ascii")))
    return reader, writer


class EventSocketFollower:
    """A router's connection: the index actor's log as it grows, one delta per frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(
        cls, endpoint: Endpoint, epoch: str | None, cursor: int, timeout_s: float = CONNECT_TIMEOUT_S
    ) -> EventSocketFollower:
        """Follow from (`epoch`, `cursor`). Raises `OSError`, `TimeoutError` or `EOFError` when
        the actor cannot be reached, or `PermissionError` when what answered is not it."""
        reader, writer = await _open(endpoint, FOLLOWER, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                proof = await _read_async(reader, MAX_TOKEN)
            if not secrets.compare_digest(proof, endpoint[3].encode("ascii")):
                raise PermissionError("the event socket's answer is not the index actor's")
            writer.write(_frame(pickle.dumps((epoch, cursor))))
        except BaseException:
            writer.transport.abort()
            raise
        return cls(reader, writer)

    async def next(self, timeout_s: float = 10 * HEARTBEAT_S) -> Any:
        """The next delta (None: a heartbeat); `TimeoutError` when not even a heartbeat came
        within `timeout_s` (a connection that went silent), `EOFError` at its end."""
        async with asyncio.timeout(timeout_s):
            payload = await _read_async(self._reader, MAX_FRAME)
        return pickle.loads(payload) if payload else None

    def close(self) -> None:
        self._writer.transport.abort()


async def _read_async(reader: asyncio.StreamReader, limit: int) -> bytes:
    n = int.from_bytes(await reader.readexactly(HEADER), "little")
    if n > limit:
        raise ValueError(f"a frame of {n} bytes (at most {limit})")
    return await reader.readexactly(n)
