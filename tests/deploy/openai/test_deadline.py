"""`fanout._Deadline`: one timer bounds every wait of a stream for its worker deltas."""

from __future__ import annotations

import asyncio

import pytest

from deploy.openai.fanout import DeadlineExceeded, _Deadline


def test_a_wait_in_progress_at_the_deadline_raises_deadline_exceeded() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = _Deadline(loop.time() + 0.01)
        assert await d.wait(lambda: asyncio.sleep(0, "first")) == "first"  # a step, no timing
        with pytest.raises(DeadlineExceeded):
            await d.wait(asyncio.Event().wait)  # never set: only the deadline ends it
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        d.disarm()

    asyncio.run(main())


def test_a_deadline_passed_between_waits_fails_the_next_wait_at_once() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = _Deadline(loop.time())
        while not d.expired:  # the timer runs on the loop; no wait is in progress meanwhile
            await asyncio.sleep(0)  # a yield to the loop, not a wait: the deadline is now
        calls: list[int] = []
        with pytest.raises(DeadlineExceeded):
            await d.wait(lambda: calls.append(1) or asyncio.sleep(0))  # type: ignore[func-returns-value]
        assert calls == []  # the step was not even started

    asyncio.run(main())


def test_a_caller_cancelled_at_the_deadline_stays_cancelled() -> None:
    """The client leaving wins over the deadline: the task sees CancelledError, not a 504."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = _Deadline(loop.time() + 3600)
        task = asyncio.create_task(d.wait(asyncio.Event().wait))
        await asyncio.sleep(0)  # the wait is in progress
        task.cancel()  # the client left ...
        d._expire()  # ... and the deadline fires before the task ran again
        with pytest.raises(asyncio.CancelledError):
            await task
        d.disarm()

    asyncio.run(main())


def test_no_deadline_waits_as_long_as_it_takes() -> None:
    async def main() -> None:
        d = _Deadline(None)
        assert await d.wait(lambda: asyncio.sleep(0.01, "done")) == "done"  # the step itself
        d.disarm()

    asyncio.run(main())
