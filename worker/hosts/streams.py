"""One request's stream of deltas on its caller's event loop, shared by both engine hosts.

A host registers the stream's queue under its lock (so its death either fails the stream or the
stream is never registered), starts the request, then relays deltas until the last one; however
the relay stops (the caller closed it, the start failed, the engine died) the host's `end` runs,
and a stream that did not finish is aborted there.

Each wake-up of the relay takes everything queued for the request since the last one and yields
it as one delta (`merge_deltas`): when the consumer (the replica's stream to the ingress) is
slower than the engine, the tokens of several steps travel as one item instead of one each.

A request that can never run is refused by its add (the engine's checks, a grammar compiled):
the relay's first step raises that `ValueError`, before any delta, and the replica answers with
a refusing `StreamStart` (no separate validation round trip before the add).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable

from core.outputs import StreamDelta
from worker.errors import EngineGoneError

_Item = StreamDelta | EngineGoneError | ValueError


class DeltaQueue(asyncio.Queue[_Item]):
    """One stream's deltas, or its end: the engine gone, or the add refused (a ValueError).

    Diverted (`divert`), its unfinished deltas go to a callback as they arrive instead, in
    order, and the relay wakes only for the last delta or the end: a worker replica's request
    whose deltas travel on a delta channel (`deploy/replica/outbox.py`) costs no wake-up of its
    own per step. All on the stream's event loop.
    """

    _divert: Callable[[StreamDelta], bool] | None = None

    def put_nowait(self, item: _Item) -> None:
        divert = self._divert
        if divert is not None:
            if isinstance(item, StreamDelta) and not item.finished and divert(item):
                return
            self._divert = None  # the end, or refused: from here on the relay has them, in order
        super().put_nowait(item)

    def divert(self, to: Callable[[StreamDelta], bool]) -> bool:
        """Send the unfinished deltas to `to` from now on, those already queued first; `to`
        returns False to refuse one (that one and the rest stay queued). False when diverting
        stopped before it started: a finished delta or the end was already queued, or `to`
        refused."""
        held: list[_Item] = []
        while not self.empty():
            held.append(self.get_nowait())
        sent = 0
        for item in held:
            if not (isinstance(item, StreamDelta) and not item.finished and to(item)):
                break
            sent += 1
        for item in held[sent:]:
            super().put_nowait(item)
        if sent < len(held):
            return False
        self._divert = to
        return True


async def relay(
    open_stream: Callable[[], DeltaQueue],
    start: Callable[[DeltaQueue], Awaitable[None]],
    end: Callable[[bool], None],
) -> AsyncGenerator[StreamDelta, None]:
    """Yield the deltas of the request `start` submits, everything queued at each wake-up
    merged into one; `end(finished)` runs once it stops. Raises the `ValueError` of a refused
    add before any delta, and `EngineGoneError` after the deltas queued before it."""
    deltas = open_stream()
    finished = False
    try:
        await start(deltas)
        while not finished:
            got: list[StreamDelta] = []
            item = await deltas.get()
            while isinstance(item, StreamDelta):
                got.append(item)
                if deltas.empty():
                    break
                item = deltas.get_nowait()
            if got:
                delta = merge_deltas(got)
                finished = delta.finished
                yield delta
            if not isinstance(item, StreamDelta):
                finished = True  # nothing left to abort: never added, or the engine is gone
                raise item
    finally:
        end(finished)


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Coalesce consecutive deltas of one request into one."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    tokens = [t for d in deltas for t in d.token_ids]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    prompt_logprobs = next(
        (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None
    )
    return dataclasses.replace(
        last, token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )


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

    def _route(self, deltas: list[StreamDelta]) -> None:
        """One engine step's deltas (any thread) into their streams' queues: one callback per
        event loop for the whole step, not one per delta."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaQueue, StreamDelta]]] = {}
        with self._lock:
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    per_loop.setdefault(stream[0], []).append((stream[1], delta))
        for loop, items in per_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def divert(self, request_id: str, to: Callable[[StreamDelta], bool]) -> bool:
        """`DeltaQueue.divert` for a running stream of this host, on its loop (False: none)."""
        with self._lock:
            stream = self._streams.get(request_id)
        return stream is not None and stream[1].divert(to)

    def _open(self, request_id: str) -> DeltaQueue:
        deltas = DeltaQueue()
        with self._lock:  # with the host's death: a stream is failed by it or never registered
            self._check_alive()
            self._streams[request_id] = (asyncio.get_running_loop(), deltas)
        return deltas

    def _end(self, request_id: str, finished: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if not finished:
            self.abort(request_id)


def _put_all(items: list[tuple[DeltaQueue, StreamDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)
