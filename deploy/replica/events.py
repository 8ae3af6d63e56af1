"""A worker replica's cache events -> the deployment's index actor (`cluster.transport`).

The engine queues `CacheEvent`s as its radix cache changes; this pump drains them, stamps each
non-empty drain with the next sequence number (1, 2, 3, … per incarnation) and publishes it.
It flushes after every finished request (before the final delta goes back, so the next routing
decision sees the cache that request left) and every `interval_s` in the background (evictions
and SWA frees happen between requests too). It also carries the replica's stats samples to the
same actor, where the ingress reads them for `/metrics` and `/health` (`cluster.replica_stats`):
a sample marked due (`report_soon`) rides on the next flush's push, so a request's end costs
one actor call, not two, and a step's first tokens none of their own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable

from cluster.messages import CacheSnapshot, EventBatch, StatsDict, WorkerMeta
from cluster.transport import EventPublisher, get_or_create_index_actor, index_actor_name
from core.events import CacheEvent, PageState
from core.geometry import Geometry
from worker.config import repairs_tombstones
from worker.engine.protocols import DrainsAtOnce, EngineClient

log = logging.getLogger("swaserve.worker.events")


class CacheEventPump:
    def __init__(
        self,
        engine: EngineClient,
        worker_id: str,
        app_name: str,
        deployment_name: str,
        interval_s: float = 0.25,
    ) -> None:
        self._engine = engine
        # An engine process's events are here already: drain them on the loop (no thread hop).
        self._drain_on_loop = isinstance(engine, DrainsAtOnce)
        self._incarnation = uuid.uuid4().hex[:12]
        self._worker_id = worker_id
        self._actor_name = index_actor_name(app_name, deployment_name)
        self._interval_s = interval_s
        self._seq = 0
        # snapshots run on the loop thread, drains in a worker thread
        self._seq_lock = threading.Lock()
        self._flush_lock = asyncio.Lock()
        self._flush_calls = 0  # flush() calls so far
        self._flushed = 0  # every call up to this number is published
        self._start_lock = asyncio.Lock()
        self._publisher: EventPublisher | None = None
        self._task: asyncio.Task[None] | None = None
        self._reports: set[asyncio.Task[None]] = set()  # stats reports in flight
        self._due: Callable[[], StatsDict] | None = None  # `report_soon`'s sampler, not yet sent
        self._closed = False

    def _meta(self) -> WorkerMeta:
        stats, engine = self._engine.stats(), self._engine
        return WorkerMeta(
            worker_id=self._worker_id,
            incarnation=self._incarnation,
            geometry=Geometry(int(engine.config.page_size), engine.window, engine.swa_layers),
            full_tokens=stats.full.total,
            swa_tokens=stats.swa.total,
            hybrid=stats.hybrid,
            tombstone_repair=repairs_tombstones(engine.config),
            tier_costs=engine.tier_costs,
            host_full_tokens=stats.host_full.total,
        )

    async def ensure_started(self) -> None:
        """Register with the index actor (once) and start the background flush loop."""
        if self._publisher is not None:
            return
        async with self._start_lock:
            if self._publisher is not None:
                return
            # A blocking GCS lookup (and the actor's creation the first time): off the loop.
            actor = await asyncio.to_thread(get_or_create_index_actor, self._actor_name)
            publisher = EventPublisher(actor, self._meta(), self._snapshot)
            await publisher.start()
            self._publisher = publisher
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _snapshot(self) -> CacheSnapshot:
        # Runs in a worker thread (EventPublisher's contract). Events still queued are folded
        # into the snapshot, so its seq covers them; the engine takes both between two steps.
        with self._seq_lock:
            events, pages = self._drain_and_snapshot()
            if events:
                self._seq += 1
            return CacheSnapshot(self._worker_id, self._incarnation, self._seq, dict(pages))

    def _drain_and_snapshot(self) -> tuple[list[CacheEvent], dict[int, PageState]]:
        return self._engine.drain_and_snapshot()

    def _drain_batch(self) -> EventBatch | None:
        with self._seq_lock:
            events = self._engine.drain_cache_events()
            if not events:
                return None
            self._seq += 1
            return EventBatch(self._worker_id, self._incarnation, self._seq, tuple(events))

    async def flush(self) -> None:
        """Publish every event the engine queued before this call.

        Group commit: callers that arrive while a flush runs share the next one (a flush
        covers every call made before its drain), so many requests ending at once cost two
        drains and publishes, not one each. A stats sample due (`report_soon`) goes with the
        push, sampled as it leaves; alone when there is no event to push."""
        if self._publisher is None:
            return
        self._flush_calls += 1
        mine = self._flush_calls
        async with self._flush_lock:  # drains and publishes stay in seq order
            if self._flushed >= mine:
                return  # a flush that drained after this call was made covered it
            covers = self._flush_calls
            # NOTE: an in-process engine drains between two steps, so this waits for the step
            # in flight; off the event loop, so other requests' deltas keep flowing meanwhile.
            # An engine process's drain does not wait: on the loop.
            if self._drain_on_loop:
                batch = self._drain_batch()
            else:
                batch = await asyncio.to_thread(self._drain_batch)
            stats = self._take_due()
            if batch is not None:
                await self._publisher.publish(batch, stats)
            elif stats is not None and not self._closed:
                await self._publisher.refresh_stats(stats)  # on the event socket too
            self._flushed = covers

    def report_stats(self, stats: StatsDict, *, register: bool) -> None:
        """Send a stats sample to the index actor in the background (once started; no wait)."""
        if self._publisher is None:
            return
        task = asyncio.get_running_loop().create_task(self._report(stats, register))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def report_soon(self, sample: Callable[[], StatsDict]) -> None:
        """Mark a fresh stats sample due: `sample()` is taken and sent with the next flush (a
        finished request's, or the background one within `interval_s`). Calls before that
        flush share its one sample, so the requests of a step cost no actor call of their own."""
        self._due = sample

    def _take_due(self) -> StatsDict | None:
        sample, self._due = self._due, None
        return sample() if sample is not None else None

    async def _report(self, stats: StatsDict, register: bool) -> None:
        # NOTE: a report that starts after close() would register the replica again.
        if self._publisher is not None and not self._closed:
            await self._publisher.report_stats(stats, register=register)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - keep publishing; the index resyncs on gaps
                log.exception("publishing cache events failed")

    def close(self) -> None:
        """Stop the loop and tell the index this incarnation is gone (best effort, no waiting)."""
        if self._task is not None:
            self._task.cancel()
        self._closed = True
        if self._publisher is not None:
            try:
                self._publisher.close_nowait()
            except Exception:  # noqa: BLE001 - the index also drops dead replicas on its own
                log.warning("could not deregister %s from the cache index", self._worker_id)
