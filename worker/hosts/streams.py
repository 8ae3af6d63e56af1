"""One request's stream of deltas on its caller's event loop, shared by both engine hosts.

A host registers the stream's queue under its lock (so its death either fails the stream or the
stream is never registered), starts the request, then relays deltas until the last one; however
the relay stops (the caller closed it, the start failed, the engine died) the host's `end` runs,
and a stream that did not finish is aborted there.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable

from core.outputs import StreamDelta
from worker.errors import EngineGoneError

DeltaQueue = asyncio.Queue["StreamDelta | EngineGoneError"]  # one stream's deltas, or its end


async def relay(
    open_stream: Callable[[], DeltaQueue],
    start: Callable[[DeltaQueue], Awaitable[None]],
    end: Callable[[bool], None],
) -> AsyncGenerator[StreamDelta, None]:
    """Yield the deltas of the request `start` submits; `end(finished)` runs once it stops."""
    deltas = open_stream()
    finished = False
    try:
        await start(deltas)
        while not finished:
            delta = await deltas.get()
            if isinstance(delta, EngineGoneError):
                finished = True  # nothing left to abort
                raise delta
            finished = delta.finished
            yield delta
    finally:
        end(finished)


class StreamingHost:
    """The stream bookkeeping both hosts share. A host sets `_lock` and `_streams` and defines
    `_check_alive` (raises once the engine is gone) and `abort`."""

    _lock: threading.Lock
    _streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaQueue]]

    def _check_alive(self) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _relay(
        self, request_id: str, start: Callable[[DeltaQueue], Awaitable[None]]
    ) -> AsyncGenerator[StreamDelta, None]:
        return relay(
            functools.partial(self._open, request_id),
            start,
            functools.partial(self._end, request_id),
        )

    def _open(self, request_id: str) -> DeltaQueue:
        deltas: DeltaQueue = asyncio.Queue()
        with self._lock:  # with the host's death: a stream is failed by it or never registered
            self._check_alive()
            self._streams[request_id] = (asyncio.get_running_loop(), deltas)
        return deltas

    def _end(self, request_id: str, finished: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if not finished:
            self.abort(request_id)
