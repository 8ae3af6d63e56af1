"""`CacheEventPump.flush` is a group commit: flushes called while one runs share the next drain
(many requests ending in one step must not queue one drain each behind the step in flight)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

from cluster.messages import EventBatch
from core.events import CacheEvent, EventKind
from deploy.replica.events import CacheEventPump
from worker.engine.protocols import EngineClient


class _SlowDrains:
    """Each drain waits for `release` (the step in flight) and returns one event."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.drains = 0

    def drain_cache_events(self) -> list[CacheEvent]:
        assert self.release.wait(60), "never released"
        self.drains += 1
        return [CacheEvent(EventKind.STORED, (self.drains,))]


class _Publisher:
    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    async def publish(self, batch: EventBatch) -> None:
        self.batches.append(batch)


async def _until(cond: Any, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "condition not met before the deadline"
        await asyncio.sleep(0.01)  # waits on the condition, polled until the deadline


def test_flushes_during_a_flush_share_the_next_drain() -> None:
    engine = _SlowDrains()
    pump = CacheEventPump(cast(EngineClient, engine), "w1", "app", "Worker")
    publisher = _Publisher()
    pump._publisher = publisher  # type: ignore[assignment]  # started, without an index actor

    async def main() -> None:
        first = asyncio.create_task(pump.flush())  # drains, held by the step in flight
        await _until(lambda: pump._flush_calls == 1)
        rest = [asyncio.create_task(pump.flush()) for _ in range(9)]
        await _until(lambda: pump._flush_calls == 10)
        engine.release.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), 60)
        await pump.flush()  # a call after all of them: a drain of its own

    asyncio.run(main())
    assert engine.drains == 3  # not 11
    assert [b.seq for b in publisher.batches] == [1, 2, 3]
    assert [b.events[0].page_hashes for b in publisher.batches] == [(1,), (2,), (3,)]
