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
        self.with_stats: list[dict[str, float] | None] = []  # the sample sent with each batch
        self.reports: list[tuple[dict[str, float], bool]] = []  # samples sent alone

    async def publish(self, batch: EventBatch, stats: dict[str, float] | None = None) -> None:
        self.batches.append(batch)
        self.with_stats.append(stats)

    async def report_stats(self, stats: dict[str, float], *, register: bool) -> None:
        self.reports.append((stats, register))

    async def refresh_stats(self, stats: dict[str, float]) -> None:
        self.reports.append((stats, False))


async def _until(cond: Any, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, "condition not met before the deadline"
        await asyncio.sleep(0.01)  # waits on the condition, polled until the deadline


def _started_pump(engine: object) -> tuple[CacheEventPump, _Publisher]:
    """A pump on `engine`, started with a recording publisher instead of an index actor."""
    pump = CacheEventPump(cast(EngineClient, engine), "w1", "app", "Worker")
    publisher = _Publisher()
    pump._publisher = publisher  # type: ignore[assignment]
    return pump, publisher


def test_flushes_during_a_flush_share_the_next_drain() -> None:
    engine = _SlowDrains()
    pump, publisher = _started_pump(engine)

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


class _Drains:
    """An engine whose next drain returns `events` of them (then none)."""

    def __init__(self) -> None:
        self.events = 0

    def drain_cache_events(self) -> list[CacheEvent]:
        n, self.events = self.events, 0
        return [CacheEvent(EventKind.STORED, (i,)) for i in range(n)]

    drain_cache_events_now = drain_cache_events


def test_due_stats_ride_on_the_next_push_one_sample_for_many_requests() -> None:
    """The requests of a step mark a sample due many times: it is taken once, as the flush's
    push leaves, and goes with the events; a flush with no events sends it alone; a flush
    with nothing due sends no sample."""
    engine = _Drains()
    pump, publisher = _started_pump(engine)
    taken = iter(range(1, 100))

    def sample() -> dict[str, float]:
        return {"n": float(next(taken))}

    async def main() -> None:
        for _ in range(10):
            pump.report_soon(sample)
        assert publisher.with_stats == [] and publisher.reports == []  # no call of their own
        engine.events = 3
        await pump.flush()  # a request's end: the events and the sample, one push
        await pump.flush()  # nothing queued, nothing due: no call at all
        pump.report_soon(sample)
        await pump.flush()  # the background flush: no events, the sample alone
        engine.events = 1
        await pump.flush()

    asyncio.run(main())
    assert [len(b.events) for b in publisher.batches] == [3, 1]
    assert publisher.with_stats == [{"n": 1.0}, None]  # sampled once for the ten requests
    assert publisher.reports == [({"n": 2.0}, False)]


class _ProcessDrains:
    """An engine process's host: its events are here already (`DrainsAtOnce`)."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def drain_cache_events(self) -> list[CacheEvent]:
        self.threads.append(threading.get_ident())
        return [CacheEvent(EventKind.STORED, (len(self.threads),))]

    drain_cache_events_now = drain_cache_events


def test_an_engine_process_is_drained_on_the_loop() -> None:
    """No thread hop per flush when the drain cannot wait: the loop's own thread drains."""
    engine = _ProcessDrains()
    pump, publisher = _started_pump(engine)

    async def main() -> int:
        await pump.flush()
        await pump.flush()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert engine.threads == [loop_thread, loop_thread]
    assert [b.seq for b in publisher.batches] == [1, 2]
