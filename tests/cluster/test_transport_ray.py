"""Event transport through real Ray actors: push/pull, long poll, gaps, resync, incarnations,
dead-worker removal, late routers and an index-actor restart. One loopback cluster per module."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
import ray

from cluster.index import ClusterIndex
from cluster.messages import WorkerRemoved
from cluster.ray_local import LocalRayConfig, start_local_ray, stop_local_ray
from cluster.transport import (
    EventPublisher,
    IndexSubscriber,
    get_or_create_index_actor,
    index_actor_name,
    kill_index_actor,
)
from worker.protocol import CacheEvent, CacheSnapshot, EventBatch, EventKind, PageState, WorkerMeta

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    cluster = start_local_ray(LocalRayConfig(num_cpus=1))
    yield
    stop_local_ray(cluster)


@pytest.fixture
def actor_name(ray_cluster: None) -> Iterator[str]:
    name = index_actor_name("test", uuid.uuid4().hex[:8])
    yield name
    kill_index_actor(name)


class FakeCache:
    """What a worker's radix cache does, reduced to pages and a drain counter."""

    def __init__(self, wid: str, inc: str) -> None:
        self.meta = WorkerMeta(wid, inc, 4, 8, full_tokens=4096, swa_tokens=1024, hybrid=True)
        self.pages: dict[int, PageState] = {}
        self.seq = 0
        self.pending: list[CacheEvent] = []
        self.snapshots = 0

    def store(self, *hashes: int) -> None:
        self.pages.update(dict.fromkeys(hashes, PageState.LIVE))
        self.pending.append(CacheEvent(EventKind.STORED, hashes))

    def drain(self) -> EventBatch:
        self.seq += 1
        batch = EventBatch(self.meta.worker_id, self.meta.incarnation, self.seq, tuple(self.pending))
        self.pending = []
        return batch

    def snapshot(self) -> CacheSnapshot:
        self.snapshots += 1
        return CacheSnapshot(self.meta.worker_id, self.meta.incarnation, self.seq, dict(self.pages))


def _pages(index: ClusterIndex, wid: str) -> set[int] | None:
    snap = index.snapshot(wid)
    return None if snap is None else set(snap.pages)


async def _started(actor: ray.actor.ActorHandle, cache: FakeCache) -> EventPublisher:
    publisher = EventPublisher(actor, cache.meta, cache.snapshot)
    await publisher.start()
    return publisher


def test_push_then_pull(actor_name: str) -> None:
    """Published batches reach a router's index through the actor."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        cache.store(1, 2)
        await publisher.publish(cache.drain())
        sub = IndexSubscriber(actor, ClusterIndex())
        assert await sub.sync()
        assert _pages(sub.index, "w0") == {1, 2}
        assert not await sub.sync()  # nothing new

    asyncio.run(run())


def test_long_poll_delivers_quickly(actor_name: str) -> None:
    """A router's background long poll sees a push well within a second."""

    async def run() -> float:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        sub = IndexSubscriber(actor, ClusterIndex(), wait_s=5.0)
        sub.start()
        assert await sub.wait_ready(10.0)
        cache.store(7)
        t0 = time.perf_counter()
        await publisher.publish(cache.drain())
        while _pages(sub.index, "w0") != {7}:
            assert time.perf_counter() - t0 < 1.0, "long poll did not deliver the push"
            await asyncio.sleep(0.001)
        await sub.stop()
        return time.perf_counter() - t0

    assert asyncio.run(run()) < 1.0


def test_gap_triggers_snapshot_resync(actor_name: str) -> None:
    """A lost batch makes the actor ask for a snapshot; routers go stale (0), then heal."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        cache.store(1)
        await publisher.publish(cache.drain())
        cache.store(2)
        cache.drain()  # seq 2 is lost in transit
        sub = IndexSubscriber(actor, ClusterIndex())
        cache.store(3)
        ack = await actor.push.remote(cache.drain())  # seq 3 straight to the actor: a gap
        assert ack.resync_needed
        await sub.sync()
        assert sub.index.worker("w0").stale and _pages(sub.index, "w0") is None
        before = cache.snapshots
        cache.store(4)
        await publisher.publish(cache.drain())  # seq 4: the actor is stale → publisher resyncs
        assert cache.snapshots == before + 1
        await sub.sync()
        assert _pages(sub.index, "w0") == {1, 2, 3, 4}

    asyncio.run(run())


def test_new_incarnation_starts_clean(actor_name: str) -> None:
    """A restarted replica (same id, new incarnation) replaces the old pages with its own."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        old = FakeCache("w0", "old")
        publisher = await _started(actor, old)
        old.store(1, 2)
        await publisher.publish(old.drain())
        sub = IndexSubscriber(actor, ClusterIndex())
        await sub.sync()
        new = FakeCache("w0", "new")
        await _started(actor, new)
        await sub.sync()
        assert sub.index.worker("w0").meta.incarnation == "new" and _pages(sub.index, "w0") == set()
        ack = await actor.push.remote(old.drain())  # a straggler from the old incarnation
        assert ack.resync_needed
        await sub.sync()
        assert sub.index.worker("w0") is None  # dropped: never the old pages again

    asyncio.run(run())


def test_dead_worker_removed(actor_name: str) -> None:
    """close() (graceful) and a router's remove (replica died) both drop the worker."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        a, b = FakeCache("a", "i"), FakeCache("b", "i")
        pub_a, pub_b = await _started(actor, a), await _started(actor, b)
        a.store(1)
        b.store(1)
        await pub_a.publish(a.drain())
        await pub_b.publish(b.drain())
        sub = IndexSubscriber(actor, ClusterIndex())
        await sub.sync()
        await pub_a.close()
        await actor.remove.remote(WorkerRemoved("b"))
        await sub.sync()
        assert len(sub.index) == 0 and sub.index.page_map.get(1) is None

    asyncio.run(run())


def test_late_router_and_actor_restart(actor_name: str) -> None:
    """A late router bootstraps from the actor; after the actor restarts, both sides resync."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        cache.store(1)
        await publisher.publish(cache.drain())
        sub = IndexSubscriber(actor, ClusterIndex())
        await sub.sync()
        late = IndexSubscriber(actor, ClusterIndex())
        await late.sync()
        assert _pages(late.index, "w0") == {1}
        ray.kill(actor, no_restart=False)  # Ray restarts it empty, with a new epoch
        cache.store(2)
        for _ in range(100):  # calls fail while it restarts; the publisher retries per batch
            await publisher.publish(cache.drain())
            try:
                if (await actor.describe.remote())["workers"].get("w0"):
                    break
            except ray.exceptions.RayActorError:
                pass
            await asyncio.sleep(0.1)
        await sub.sync()
        assert _pages(sub.index, "w0") == {1, 2}

    asyncio.run(run())
