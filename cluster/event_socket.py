"""Worker pushes to the index actor on a plain TCP connection instead of an actor call each.

A Ray actor call costs the index actor ~420 µs of CPU for an empty method on the 2-core
development machine and a 150-page push ~760 µs, and about as much again on the worker replica
that makes it (`swaserve bench index-actor`); a worker replica pushes once per finished request.
The same push as a frame on a socket costs each side tens of µs. So the index actor listens on
one TCP port of its node's address (opened on the first `event_endpoint` call), and each worker
replica's `EventPublisher` connects once, sends the token it got from that call (over Ray's own
call: the actor unpickles a connection's frames only after its first frame matched), then one
frame per push: a 4-byte little-endian length and the pickled (batch, stats); the actor answers
each with one byte, 1 when it wants a resync (`PushAck.resync_needed`), after it applied the
batch. Everything
else (resyncs, stats reports, removal, pulls) stays an actor call.

A connection that fails (the actor restarted: a new port and token; a network that blocks the
port) ends; the publisher asks for a resync (the push may or may not have been applied) and
connects again at its next push, or carries its pushes on actor calls for `UNREACHABLE_S` when
it could not connect.
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

Endpoint = tuple[str, int, str]  # host, port, token


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

    def __init__(self, host: str, push: Callable[[Any, Any], bool]) -> None:
        self._push = push
        self.token = secrets.token_hex(16)
        self._sock = socket.create_server((host, 0))
        self.endpoint: Endpoint = (host, int(self._sock.getsockname()[1]), self.token)
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
                if hello is None or not secrets.compare_digest(hello, self.token.encode("ascii")):
                    log.warning("event socket: a connection without the token was closed unread")
                    return
                while (payload := _read_frame(conn, MAX_FRAME)) is not None:
                    batch, stats = pickle.loads(payload)
                    conn.sendall(b"\x01" if self._push(batch, stats) else b"\x00")
            except Exception as e:  # noqa: BLE001 - the connection ends; the worker resyncs
                log.warning("event socket connection ended: %s", e)

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
        host, port, token = endpoint
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(_frame(token.encode("ascii")))
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
