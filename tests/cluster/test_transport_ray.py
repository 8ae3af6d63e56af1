"""Through real Ray (one loopback cluster for the module): the event transport (push/pull, long
poll, gaps, resync, incarnations, dead-worker removal, late routers, index-actor restart) and the
SwaPrefixRequestRouter in a Serve app of two fake worker replicas.

The fake worker keeps pages in a dict and applies docs/design.md §4.4 itself (the rule's agreement
with the real radix cache is tests/router/test_mirror_exact.py); the Serve test checks the
plumbing: events → actor → router, the placement the router notes in the driver's routing record,
`record_routing_stats`, affinity, predicted == reused on every request."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import ray
from ray import cloudpickle, serve
from ray.serve.config import RequestRouterConfig

from cluster.index import ClusterIndex
from cluster.index_hub import apply_delta
from cluster.messages import (
    CacheSnapshot,
    EventBatch,
    PoolHeadroom,
    RoutedRequest,
    WorkerMeta,
    WorkerRemoved,
    WorkerResync,
    make_routing_stats,
)
from cluster.ray_local import LocalRayConfig, start_local_ray, stop_local_ray
from cluster.transport import (
    EventPublisher,
    IndexSubscriber,
    find_index_actor,
    get_or_create_index_actor,
    index_actor_name,
    kill_index_actor,
)
from core.events import CacheEvent, EventKind, PageState, page_hashes
from core.geometry import Geometry
from router import routing_record
from tests.router import match_oracle
from tests.router.match_oracle import valid_match_reference

pytestmark = pytest.mark.ray

PAGE, WINDOW = 4, 8
APP = "routertest"
# Replicas cannot import tests/: what the fake worker uses from there travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(match_oracle)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    cluster = start_local_ray(LocalRayConfig(num_cpus=1))
    try:
        assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]  # loopback
        yield
    finally:
        serve.shutdown()
        stop_local_ray(cluster)


@pytest.fixture
def actor_name(ray_cluster: None) -> Iterator[str]:
    name = index_actor_name("test", uuid.uuid4().hex[:8])
    yield name
    kill_index_actor(name)


class FakeCache:
    """What a worker's radix cache does, reduced to pages and a drain counter."""

    def __init__(self, wid: str, inc: str) -> None:
        self.meta = WorkerMeta(wid, inc, Geometry(4, 8), full_tokens=4096, swa_tokens=1024, hybrid=True)
        self.pages: dict[int, PageState] = {}
        self.seq = 0
        self.pending: list[CacheEvent] = []
        self.snapshots = 0

    def store(self, *hashes: int) -> None:
        self.pages.update(dict.fromkeys(hashes, PageState.LIVE))
        self.pending.append(CacheEvent(EventKind.STORED, hashes))

    def drain(self) -> EventBatch:
        self.seq += 1
        batch = EventBatch(
            self.meta.worker_id, self.meta.incarnation, self.seq, tuple(self.pending)
        )
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
        assert publisher.socket_pushes == 1  # on the event socket, not an actor call
        sub = IndexSubscriber(actor, ClusterIndex())
        assert await sub.sync()
        assert _pages(sub.index, "w0") == {1, 2}
        assert not await sub.sync()  # nothing new

    asyncio.run(run())


def test_overlapping_pulls_apply_their_unseen_tail() -> None:
    """The long poll and a catch-up pull race: a delta that starts before the cursor (the other
    pull applied its head) still applies the rest; an older one changes nothing. No Ray needed."""
    from cluster.index_hub import IndexHub

    hub, cache = IndexHub(), FakeCache("w0", "i0")
    hub.resync(WorkerResync(cache.meta, cache.snapshot()))
    sub = IndexSubscriber(None, ClusterIndex())  # type: ignore[arg-type]  # _apply only
    assert sub._apply(hub.pull(None, 0))  # the reset: cursor at the log's end
    base = hub.end
    cache.store(1)
    hub.push(cache.drain())
    head = hub.pull(hub.epoch, base)  # what the long poll got: batch 1
    cache.store(2)
    hub.push(cache.drain())
    both = hub.pull(hub.epoch, base)  # what the catch-up got, sent before the poll's applied
    assert sub._apply(head) and sub._apply(both)
    assert _pages(sub.index, "w0") == {1, 2}
    assert not sub._apply(head)  # nothing past the cursor


def test_long_poll_delivers_a_push(actor_name: str) -> None:
    """A router's background long poll (here one that would wait 600 s) is woken by a push and
    applies it; no bound on how fast (tests never time), only that the push, not the poll's
    timeout, ended the wait."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        sub = IndexSubscriber(actor, ClusterIndex(), wait_s=600.0)
        sub.start()
        assert await sub.wait_ready(60.0)
        cache.store(7)
        await publisher.publish(cache.drain())
        deadline = time.monotonic() + 120  # far below the poll's 600 s
        while _pages(sub.index, "w0") != {7}:
            assert time.monotonic() < deadline, "the long poll did not deliver the push"
            await asyncio.sleep(0.01)  # waits on the long poll applying the push
        assert sub.socket_deltas >= 1  # it came on the event socket the loop follows
        await sub.stop()

    asyncio.run(run())


def test_waiting_long_polls_hold_up_no_push(actor_name: str) -> None:
    """The actor is threaded: pulls block in a group of their own, so routers in their long
    polls (here waiting up to 600 s) neither delay a push nor miss it."""
    actor = get_or_create_index_actor(actor_name)
    cache = FakeCache("w0", "i0")
    asyncio.run(_started(actor, cache))
    current = ray.get(actor.pull.remote(None, 0), timeout=60)
    assert current is not None
    waiting = [actor.pull.remote(current.epoch, current.cursor, 600.0) for _ in range(8)]
    cache.store(5, 6)
    ack = ray.get(actor.push.remote(cache.drain()), timeout=60)  # not behind the long polls
    assert not ack.resync_needed
    for delta in ray.get(waiting, timeout=60):  # woken by the push, not by their 600 s
        assert delta is not None and not delta.reset and delta.since == current.cursor
        index = ClusterIndex()
        apply_delta(index, current)
        apply_delta(index, delta)
        assert _pages(index, "w0") == {5, 6}
    assert ray.get(actor.describe.remote(), timeout=60)["workers"]["w0"][1] == 1  # seq


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


def test_replica_stats_through_the_index_actor(actor_name: str) -> None:
    """A publisher's stats reach the actor's board (the ingress's one read); close() drops them."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        await publisher.report_stats({"timestamp_s": 1.0, "waiting": 2.0}, register=False)
        assert await actor.replica_stats.remote(3.0, 30.0) == {}  # not registered yet
        await publisher.report_stats({"timestamp_s": 2.0, "waiting": 3.0}, register=True)
        assert await actor.replica_stats.remote(3.0, 30.0) == {
            "w0": {"timestamp_s": 2.0, "waiting": 3.0}
        }
        # A sample alone (a request started: no event with it) goes on the event socket.
        await publisher.refresh_stats({"timestamp_s": 3.0, "waiting": 4.0})
        assert publisher.socket_refreshes == 1
        assert await actor.replica_stats.remote(3.0, 30.0) == {
            "w0": {"timestamp_s": 3.0, "waiting": 4.0}
        }
        await publisher.close()
        assert await actor.replica_stats.remote(3.0, 30.0) == {}

    asyncio.run(run())


def test_an_idle_worker_resyncs_through_its_stats_report(actor_name: str) -> None:
    """After the actor restarted empty, a replica with no events to push is back in the index
    (with its pages) at its next registering stats report."""

    async def run() -> None:
        actor = get_or_create_index_actor(actor_name)
        cache = FakeCache("w0", "i0")
        publisher = await _started(actor, cache)
        cache.store(1, 2)
        await publisher.publish(cache.drain())
        old_epoch = (await actor.describe.remote())["epoch"]
        ray.kill(actor, no_restart=False)  # Ray restarts it empty
        deadline = time.monotonic() + 120
        while True:
            await publisher.report_stats({"timestamp_s": time.time()}, register=True)
            try:
                # NOTE: the kill takes a moment: the old actor may answer (and hold w0) first.
                now = await actor.describe.remote()
                if now["epoch"] != old_epoch and now["workers"].get("w0"):
                    break
            except ray.exceptions.RayActorError:
                pass
            assert time.monotonic() < deadline, "the idle worker never came back"
            await asyncio.sleep(0.1)  # waits on Ray restarting the actor
        sub = IndexSubscriber(actor, ClusterIndex())
        await _sync_through_restart(sub)
        assert _pages(sub.index, "w0") == {1, 2}

    asyncio.run(run())


def test_subscriber_stops_when_actor_killed(actor_name: str) -> None:
    """find_index_actor never creates; a subscriber stops following once the actor is killed."""

    async def run() -> None:
        assert find_index_actor(actor_name) is None
        actor = get_or_create_index_actor(actor_name)
        assert find_index_actor(actor_name) is not None
        sub = IndexSubscriber(actor, ClusterIndex(), wait_s=5.0)
        sub.start()
        assert await sub.wait_ready(10.0)
        kill_index_actor(actor_name)
        deadline = time.monotonic() + 60
        while not sub.stopped:
            assert time.monotonic() < deadline, "the subscriber still follows a killed actor"
            await asyncio.sleep(0.05)  # waits on the long poll seeing the actor die

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
        old_epoch = (await actor.describe.remote())["epoch"]
        ray.kill(actor, no_restart=False)  # Ray restarts it empty, with a new epoch
        cache.store(2)
        deadline = time.monotonic() + 120
        while True:  # calls fail while it restarts; the publisher retries per batch
            await publisher.publish(cache.drain())
            try:
                # NOTE: the kill takes a moment: the old actor may answer (and hold w0) first.
                now = await actor.describe.remote()
                if now["epoch"] != old_epoch and now["workers"].get("w0"):
                    break
            except ray.exceptions.RayActorError:
                pass
            assert time.monotonic() < deadline, "the restarted actor never got the resync"
            await asyncio.sleep(0.1)  # waits on Ray restarting the actor
        # The subscriber's loop syncs again and again; the first sync after a restart may land
        # before the resynced pages, so wait (with a deadline) for them as its loop would.
        deadline = time.monotonic() + 120
        while True:
            await _sync_through_restart(sub)
            if _pages(sub.index, "w0") == {1, 2}:
                break
            assert time.monotonic() < deadline, f"resync never reached: {_pages(sub.index, 'w0')}"
            await asyncio.sleep(0.1)  # waits on the actor holding the publisher's resync
        # The old actor's socket died with it: the next push connects to the new one's.
        before = publisher.socket_pushes
        cache.store(3)
        await publisher.publish(cache.drain())
        assert publisher.socket_pushes == before + 1
        await _sync_through_restart(sub)
        assert _pages(sub.index, "w0") == {1, 2, 3}

    asyncio.run(run())


async def _sync_through_restart(sub: IndexSubscriber, timeout_s: float = 120.0) -> None:
    """`sub.sync()`, retried while a just-restarted actor still answers "temporarily
    unavailable" to some calls (the subscriber's own loop retries the same way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await sub.sync()
            return
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the restarted actor never answered a pull"
            await asyncio.sleep(0.1)  # waits on Ray finishing the restart


# ---- the router in a Serve app ----------------------------------------------------------


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=4,
    ray_actor_options={"num_cpus": 0.1},
    request_router_config=RequestRouterConfig(
        request_router_class="router.serve_router:SwaPrefixRequestRouter",
        request_router_kwargs={"policy": "swa_prefix"},
        request_routing_stats_period_s=0.5,
    ),
)
class FakeWorker:
    """Caches each prompt's pages; pages below a token frontier (the request id's prefix,
    `frontier:uuid`) become tombstones."""

    def __init__(self) -> None:
        ctx = serve.get_replica_context()
        self.wid = ctx.replica_id.unique_id
        self.pages: dict[int, PageState] = {}
        self.seq = 0
        meta = WorkerMeta(self.wid, uuid.uuid4().hex, Geometry(PAGE, WINDOW), 1 << 16, 1 << 14, True)
        actor = get_or_create_index_actor(index_actor_name(ctx.app_name, ctx.deployment))
        self.publisher = EventPublisher(actor, meta, self._snapshot)
        self.started = False

    async def generate(self, req: RoutedRequest) -> dict:
        if not self.started:
            await self.publisher.start()
            self.started = True
        chain = page_hashes(req.token_ids[:-1], PAGE)
        cached = valid_match_reference([self.pages.get(h) for h in chain], PAGE, WINDOW) * PAGE
        frontier = int(req.request_id.partition(":")[0] or 0)
        await self.publisher.publish(self._store(chain, frontier // PAGE))
        return {"worker": self.wid, "cached": cached}

    def record_routing_stats(self) -> dict:
        pool = PoolHeadroom(1 << 14, 0, 1 << 14)
        return make_routing_stats(
            worker_id=self.wid,
            timestamp_s=0.0,
            queue_len=0,
            queued_prefill_tokens=0,
            running_decodes=0,
            full=pool,
            swa=pool,
        )

    def _store(self, chain: list[int], tomb_pages: int) -> EventBatch:
        events = []
        for i, h in enumerate(chain):
            want = PageState.TOMBSTONE if i < tomb_pages else PageState.LIVE
            have = self.pages.get(h)
            if have is None:
                kind = EventKind.STORED if want is PageState.LIVE else EventKind.STORED_FULL_ONLY
            elif have is not want:
                kind = EventKind.SWA_RESTORED if want is PageState.LIVE else EventKind.SWA_REMOVED
            else:
                continue
            self.pages[h] = want
            events.append(CacheEvent(kind, (h,)))
        self.seq += 1
        return EventBatch(self.wid, self.publisher.meta.incarnation, self.seq, tuple(events))

    def _snapshot(self) -> CacheSnapshot:
        m = self.publisher.meta
        return CacheSnapshot(m.worker_id, m.incarnation, self.seq, dict(self.pages))


@pytest.fixture
def handle(ray_cluster: None) -> Iterator[serve.handle.DeploymentHandle]:
    serve.start(proxy_location="Disabled")
    yield serve.run(FakeWorker.bind(), name=APP, route_prefix=None).options(method_name="generate")
    serve.delete(APP)
    kill_index_actor(index_actor_name(APP, "FakeWorker"))


def _family(head: int, pages: int, extra: int = 0) -> list[int]:
    return [head * 1000 + i for i in range(pages * PAGE)] + [7] * (extra + 1)


def _send(handle, tokens: list[int], frontier: int = 0) -> dict:
    rid = f"{frontier}:{uuid.uuid4().hex}"
    out = handle.remote(RoutedRequest(tokens, request_id=rid)).result(timeout_s=30)
    # What the ingress does: read the router's placement (the router lives in this process,
    # the driver's), and note the request's end when it sees its last delta (Serve's own
    # completion report may come after the next request).
    placed = routing_record.placement_of(rid)
    out["predicted"] = (
        placed.predicted_cached_tokens if placed and placed.worker_id == out["worker"] else None
    )
    routing_record.note_finished(rid)
    return out


def test_predictions_exact_and_affine(handle) -> None:
    """Sequential mixed-prefix requests (default router kwargs): predicted == cached on the
    serving replica for every request, and shared prefixes stay on their replica."""
    results = []
    for tokens, frontier in [
        (_family(1, 6), 0),
        (_family(1, 6, extra=5), 0),  # same head: must go where family 1 lives, 6 pages cached
        (_family(2, 6), 5 * PAGE),  # family 2 stored with pages 0..4 tombstoned
        (_family(2, 6, extra=3), 0),  # its valid match is only 0 pages (1 live page < window)
        (_family(1, 3), 0),
        (_family(2, 6, extra=9), 0),  # family 2 now fully live again where it lives
    ]:
        out = _send(handle, tokens, frontier)
        results.append(out)
        assert out["predicted"] == out["cached"], (tokens[:2], out)
    assert results[1]["worker"] == results[0]["worker"] and results[1]["cached"] == 6 * PAGE
    assert results[3]["cached"] == 0
    # request 4 revived family 2 wherever it went (both had 0 valid pages): request 6 follows it
    assert results[5]["cached"] == 6 * PAGE and results[5]["worker"] == results[3]["worker"]
