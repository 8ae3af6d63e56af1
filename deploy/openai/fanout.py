"""The worker streams of one HTTP request (one per prompt), read concurrently and closed safely.

Each stream is read by its own pump task after its `StreamStart`; closing a stream early (all
of its choices cut by stop strings, or the client gone) cancels that pump, and the stream is
closed inside the pump, so no generator is ever closed while another task is iterating it
(`aclose(): asynchronous generator is already running`). A single stream needs no task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.messages import RoutedRequest, StreamStart
from core.outputs import StreamDelta

_Item = tuple["PromptStream", StreamDelta | BaseException | None]


@dataclass(eq=False)
class PromptStream:
    """One prompt's worker stream and what its first item said."""

    prompt_index: int
    request: RoutedRequest
    stream: AsyncIterator[StreamStart | StreamDelta] | None = None
    start: StreamStart | None = None
    task: asyncio.Task[None] | None = None
    closed: bool = False

    @property
    def replica(self) -> str:
        return self.start.replica_id if self.start else ""


async def _aclose(stream: AsyncIterator[StreamStart | StreamDelta] | None) -> None:
    if stream is not None:
        await stream.aclose()  # type: ignore[attr-defined]


class Fanout:
    def __init__(self, streams: list[PromptStream]) -> None:
        self.streams = streams
        self.failed: PromptStream | None = None  # the stream whose error `deltas` raised
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def deltas(self) -> AsyncIterator[tuple[PromptStream, StreamDelta]]:
        """Every stream's deltas in arrival order, until each has ended or been closed."""
        if len(self.streams) == 1:
            s = self.streams[0]
            assert s.stream is not None
            try:
                async for item in s.stream:
                    assert isinstance(item, StreamDelta), f"worker sent {type(item).__name__} mid-stream"
                    yield s, item
            except Exception:
                self.failed = s
                raise
            return
        for s in self.streams:
            s.task = asyncio.create_task(self._pump(s))
        live = len(self.streams)
        while live:
            s, got = await self._queue.get()
            if got is None:
                live -= 1
            elif isinstance(got, BaseException):
                self.failed = s
                raise got
            elif not s.closed:
                yield s, got

    async def _pump(self, s: PromptStream) -> None:
        stream, s.stream = s.stream, None
        try:
            assert stream is not None
            async for item in stream:
                self._queue.put_nowait((s, item))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            self._queue.put_nowait((s, e))
        finally:
            self._queue.put_nowait((s, None))
            await _aclose(stream)

    async def close(self, s: PromptStream) -> None:
        """Stop one stream now (aborts its remaining choices on the worker; idempotent)."""
        s.closed = True
        if s.task is not None and not s.task.done():
            s.task.cancel()
            await asyncio.gather(s.task, return_exceptions=True)
        stream, s.stream = s.stream, None
        await _aclose(stream)

    async def close_all(self) -> None:
        for s in self.streams:
            try:
                await self.close(s)
            except Exception:  # noqa: BLE001, S110 - closing must not mask the original outcome
                pass
