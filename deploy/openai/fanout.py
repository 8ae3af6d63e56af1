"""The worker streams of one HTTP request (one per prompt), read concurrently and closed safely.

Each stream is read by its own pump task after its `StreamStart`; closing a stream early (all
of its choices cut by stop strings, or the client gone) cancels that pump, and the stream is
closed inside the pump, so no generator is ever closed while another task is iterating it
(`aclose(): asynchronous generator is already running`). A single stream needs no task.

With a `deadline` (the event loop's clock), each wait for the next delta ends there:
`DeadlineExceeded`, and the caller closes the streams (which aborts the requests on the workers).
The bound is on each await, never across a `yield`: the consumer's own time (writing to a slow
client) is the write timeout's (`deploy/openai/write_timeout.py`). One timer per stream of
deltas, not one per wait (a wait per streamed token): when it fires it cancels the wait in
progress, or the next wait raises at once (`_Deadline`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from cluster.messages import RoutedRequest, StreamStart
from core.outputs import StreamDelta
from deploy.openai.schema import APIError

T = TypeVar("T")
_Item = tuple["PromptStream", StreamDelta | BaseException | None]


class DeadlineExceeded(APIError):
    """The request's deadline passed while it waited for its workers: 504, and the caller
    closes the streams."""

    def __init__(self) -> None:
        super().__init__(504, "the request took longer than the server allows (request_timeout_s) "
                         "and was stopped; ask for fewer tokens", type="timeout_error",
                         code="request_timeout")  # fmt: skip


async def before_deadline(deadline: float | None, step: Awaitable[T]) -> T:
    """`step`, or `DeadlineExceeded` once the loop's clock reaches `deadline` (None: no limit)."""
    if deadline is None:
        return await step
    try:
        async with asyncio.timeout_at(deadline):
            return await step
    except TimeoutError:
        raise DeadlineExceeded from None


class _Deadline:
    """`before_deadline` for many waits of one task in a row, with one timer for all of them."""

    def __init__(self, deadline: float | None) -> None:
        self.expired = False
        self._waiting: asyncio.Task[object] | None = None  # the task in a wait, if any
        self._cut = False  # the timer cancelled that wait
        self._timer = (
            None if deadline is None else asyncio.get_running_loop().call_at(deadline, self._expire)
        )

    def _expire(self) -> None:
        self.expired = True
        if self._waiting is not None:
            self._cut = True
            self._waiting.cancel()

    async def wait(self, step: Callable[[], Awaitable[T]]) -> T:
        """`step()`'s result; `DeadlineExceeded` once the deadline passed (before or during)."""
        if self._timer is None:
            return await step()
        if self.expired:
            raise DeadlineExceeded
        task = asyncio.current_task()
        assert task is not None
        self._waiting = task
        try:
            return await step()
        except asyncio.CancelledError:
            if not self._cut:
                raise
            self._cut = False
            if task.uncancel() > 0:
                raise  # cancelled by someone else too (the client left): that wins
            raise DeadlineExceeded from None
        finally:
            self._waiting = None
            if self._cut:  # the step ended before the cut reached it
                self._cut = False
                task.uncancel()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


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
    def __init__(self, streams: list[PromptStream], deadline: float | None = None) -> None:
        self.streams = streams
        self.deadline = deadline  # loop time; None: no deadline
        self.failed: PromptStream | None = None  # the stream whose error `deltas` raised
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def deltas(self) -> AsyncIterator[tuple[PromptStream, StreamDelta]]:
        """Every stream's deltas in arrival order, until each has ended or been closed."""
        deadline = _Deadline(self.deadline)
        try:
            if len(self.streams) == 1:
                s = self.streams[0]
                stream = s.stream
                assert stream is not None
                try:
                    while (item := await deadline.wait(lambda: anext(stream, None))) is not None:
                        assert isinstance(item, StreamDelta), f"worker sent {type(item).__name__} mid-stream"
                        yield s, item
                except DeadlineExceeded:
                    raise
                except Exception:
                    self.failed = s
                    raise
                return
            for s in self.streams:
                s.task = asyncio.create_task(self._pump(s))
            live = len(self.streams)
            while live:
                s, got = await deadline.wait(self._queue.get)
                if got is None:
                    live -= 1
                elif isinstance(got, BaseException):
                    self.failed = s
                    raise got
                elif not s.closed:
                    yield s, got
        finally:
            deadline.disarm()

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
