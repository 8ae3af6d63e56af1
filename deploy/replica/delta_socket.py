"""The delta channel's data on a plain TCP connection from the worker replica to the ingress.

A Serve stream item costs each side ~0.5 ms of CPU (the producer's report over gRPC, the
consumer's receipt on Ray's threads and the hop to the event loop: a Ray actor yielding 34
small items a second spent 1.1 ms per item, its consumer 1.3 ms; the same frames over a socket
0.07–0.25 ms each side). On a channel that is one item per engine step per (worker, ingress):
at c=8 the largest fixed cost per step of both replicas. So the channel's call stays for what
Serve gives it (pinning, the lifetime, the drain, failures), and its batches travel here.

The ingress replica listens on its node's address (`DeltaListener`, one port per replica,
chosen by the kernel); each channel's `Subscribe` carries that endpoint and a token new per
channel. The worker replica connects (`DeltaSender`), sends the token as its first frame, then
one frame per outbox batch: a 4-byte little-endian length and the pickled (nonce, item) list.
The ingress unpickles a connection's frames only after its token matched a channel it is
waiting for (the token travelled over Ray's own authenticated call); anything else is closed
unread. When the worker cannot connect (a network that blocks the port), the channel's batches
go on its call as before (docs/design.md §4.2).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Callable
from typing import cast

from cluster.messages import StreamStart
from core.outputs import StreamDelta

log = logging.getLogger("swaserve.ingress")

Items = list[tuple[str, StreamDelta | StreamStart]]
HEADER = 4  # bytes of a frame's length
MAX_TOKEN = 64  # bytes of the first frame
MAX_FRAME = 256 * 1024 * 1024  # a step of 1,024 streams with top-20 logprobs is a few MiB
CONNECT_TIMEOUT_S = 5.0


def _header(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "little")


class Receiver:
    """What an ingress channel waits for on the listener: its worker's connection, whose frames
    go to `on_items`, and that connection's end."""

    def __init__(self, listener: DeltaListener, token: str, on_items: Callable[[Items], None]) -> None:
        self._listener, self.token, self.on_items = listener, token, on_items
        self._ended = asyncio.Event()
        self._transport: asyncio.BaseTransport | None = None
        self.error: BaseException | None = None  # why the connection ended badly, if it did

    def _attach(self, transport: asyncio.BaseTransport) -> bool:
        if self._transport is not None or self._ended.is_set():
            return False  # one connection per channel
        self._transport = transport
        return True

    def _end(self, error: BaseException | None) -> None:
        if not self._ended.is_set():
            self.error = error
            self._ended.set()

    async def ended(self, timeout_s: float) -> bool:
        """Wait until the worker's connection has come and closed; False when it did not
        within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._ended.wait()
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Stop waiting: the token is forgotten and its connection, if any, closed."""
        self._listener._receivers.pop(self.token, None)
        if self._transport is not None:
            self._transport.close()
        self._end(None)


class _Inbound(asyncio.Protocol):
    """One worker's connection: the token frame, then delta frames into its receiver."""

    def __init__(self, listener: DeltaListener) -> None:
        self._listener = listener
        self._buf = bytearray()
        self._receiver: Receiver | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports (Serve's loop) are not `asyncio.Transport` subclasses.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        try:
            while len(buf) - at >= HEADER:
                n = int.from_bytes(buf[at : at + HEADER], "little")
                limit = MAX_FRAME if self._receiver is not None else MAX_TOKEN
                if n > limit:
                    raise ValueError(f"a frame of {n} bytes (at most {limit})")
                if len(buf) - at - HEADER < n:
                    break
                payload = buf[at + HEADER : at + HEADER + n]  # one copy: pickle reads a bytearray
                at += HEADER + n
                if self._receiver is None:
                    self._hello(payload)
                else:
                    self._receiver.on_items(pickle.loads(payload))
        except Exception as e:  # noqa: BLE001 - the connection ends; its channel sees why
            self._fail(e)
            return
        del buf[:at]

    def _hello(self, token: bytearray) -> None:
        receiver = self._listener._receivers.get(token.decode("ascii", "replace"))
        assert self._transport is not None
        if receiver is None or not receiver._attach(self._transport):
            raise PermissionError("a delta connection with a token no channel waits for")
        self._receiver = receiver

    def _fail(self, error: BaseException) -> None:
        if self._receiver is None:
            log.warning("delta socket: a connection was refused (%s)", error)
        else:
            log.warning("delta socket of channel %s failed: %s", self._receiver.token[:8], error)
            self._receiver._end(error)
        self._buf.clear()
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._receiver is not None:
            incomplete = len(self._buf) > 0
            self._receiver._end(exc or (ConnectionError("a frame cut short") if incomplete else None))


class DeltaListener:
    """The ingress replica's delta socket: started on first use, one port for every channel."""

    def __init__(self, host: Callable[[], str]) -> None:
        self._host = host
        self._receivers: dict[str, Receiver] = {}
        self._server: asyncio.Server | None = None
        self._failed = False
        self.endpoint: tuple[str, int] | None = None

    async def start(self) -> tuple[str, int] | None:
        """The endpoint workers connect to; None when the socket cannot be opened (channels
        then carry their batches on their calls)."""
        if self._server is None and not self._failed:
            try:
                host = self._host()
                loop = asyncio.get_running_loop()
                self._server = await loop.create_server(lambda: _Inbound(self), host, 0)
                self.endpoint = (host, self._server.sockets[0].getsockname()[1])
                log.info("delta socket listening on %s:%d", *self.endpoint)
            except OSError as e:
                self._failed = True
                log.warning("delta socket not opened (%s): delta channels stay on their calls", e)
        return self.endpoint

    def expect(self, token: str, on_items: Callable[[Items], None]) -> Receiver:
        receiver = Receiver(self, token, on_items)
        self._receivers[token] = receiver
        return receiver

    def close(self) -> None:
        for receiver in list(self._receivers.values()):
            receiver.close()
        if self._server is not None:
            self._server.close()


class DeltaSender:
    """The worker replica's end of one channel's connection."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    @classmethod
    async def connect(
        cls, endpoint: tuple[str, int], token: str, timeout_s: float = CONNECT_TIMEOUT_S
    ) -> DeltaSender:
        """Raises `OSError` (or `TimeoutError`) when the ingress cannot be reached."""
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(*endpoint)
        hello = token.encode("ascii")
        writer.writelines((_header(hello), hello))
        return cls(writer)

    async def send(self, items: Items) -> None:
        """One frame; waits while the ingress is behind (the outbox gathers the next batch
        meanwhile). Raises `ConnectionError` once the ingress closed the connection."""
        if self._writer.transport.is_closing():  # uvloop raises RuntimeError on a write
            raise ConnectionResetError("the ingress closed the delta socket")
        payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.writelines((_header(payload), payload))
        await self._writer.drain()

    async def close(self) -> None:
        """Every frame written reaches the ingress before the connection's end does."""
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass

    def abort(self) -> None:
        self._writer.transport.abort()
