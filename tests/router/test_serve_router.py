"""SwaPrefixRequestRouter without a Ray cluster: fake replicas, the real Serve routing loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from ray.serve.request_router import PendingRequest, ReplicaID
from routing_builders import PAGE, index_with, prompt

from cluster.messages import PoolHeadroom, RoutedRequest, make_routing_stats
from router import routing_record
from router.metrics import RoutingMetrics
from router.pinned import PinnedCall
from router.serve_router import SwaPrefixRequestRouter
from tests import serve_internals

_SERVE = serve_internals.serve_common()  # DeploymentID, DeploymentHandleSource, RequestMetadata
DEP = _SERVE.DeploymentID(name="Worker", app_name="app")


@dataclass
class FakeReplica:
    """What Serve's routing loop reads from a RunningReplica."""

    name: str
    routing_stats: dict = field(default_factory=dict)
    queue_len: int = 0
    max_ongoing_requests: int = 8
    multiplexed_model_ids: set = field(default_factory=set)
    node_id: str = "node"
    availability_zone: str | None = None
    is_cross_language: bool = False

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=DEP)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _router(policy: str = "swa_prefix") -> SwaPrefixRequestRouter:
    source = _SERVE.DeploymentHandleSource.REPLICA
    router = SwaPrefixRequestRouter(deployment_id=DEP, handle_source=source)
    router.initialize_state(policy=policy, subscribe=False)
    router.metrics = RoutingMetrics(CollectorRegistry())
    return router


def _pending(tokens: list[int], rid: str = "r1") -> PendingRequest:
    meta = _SERVE.RequestMetadata(request_id=rid, internal_request_id=rid)
    return PendingRequest(args=[RoutedRequest(tokens, request_id=rid)], kwargs={}, metadata=meta)


def _stats(wid: str, queued: int = 0) -> dict:
    pool = PoolHeadroom(4096, 0, 4096)
    return make_routing_stats(
        worker_id=wid,
        timestamp_s=0.0,
        queue_len=0,
        queued_prefill_tokens=queued,
        running_decodes=0,
        full=pool,
        swa=pool,
    )


def test_ranks_by_valid_match_and_records_the_placement() -> None:
    """The replica with the valid copy is ranked first; once Serve says it took the request,
    the routing record holds that placement with its prediction, and args[0] is unchanged."""
    tokens = prompt(6)

    async def run() -> None:
        router = _router()
        router.core.index = index_with(tokens, {"a": "LLLLLL", "b": "LLLLTT"})
        replicas = [FakeReplica("b", _stats("b")), FakeReplica("a", _stats("a"))]
        pending = _pending(tokens)
        ranks = await router.choose_replicas(replicas, pending)
        assert [[r.name for r in rank] for rank in ranks] == [["a"], ["b"]]
        router.on_request_routed(pending, replicas[1].replica_id, None)  # Serve: a took it
        placed = routing_record.placement_of("r1")
        assert placed is not None and (placed.worker_id, placed.policy) == ("a", "swa_prefix")
        assert placed.predicted_cached_tokens == 6 * PAGE
        assert pending.args[0] == RoutedRequest(tokens, request_id="r1")

    asyncio.run(run())


def test_full_routing_loop_skips_busy_first_rank() -> None:
    """Through Serve's own loop: the best replica wins; at max_ongoing the next rank serves."""
    tokens = prompt(4)

    async def run() -> None:
        router = _router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        router.core.index = index_with(tokens, {"a": "LLLL", "b": ""})
        chosen = await asyncio.wait_for(serve_internals.route_one(router, _pending(tokens)), 5)
        assert chosen.name == "a"
        router.on_request_completed(a.replica_id, "r1")
        a.queue_len = a.max_ongoing_requests
        pending = _pending(tokens, "r2")
        chosen = await asyncio.wait_for(serve_internals.route_one(router, pending), 5)
        assert chosen.name == "b"
        assert router.core.inflight.worker_of("r2") == "a"  # ranked first, so recorded there
        router.on_request_routed(pending, chosen.replica_id, None)  # Serve: b took it
        assert router.core.pending.worker_of("r2") == "b"
        assert router.core.inflight.worker_of("r2") == "b"
        placed = routing_record.placement_of("r2")  # the prediction for b, not the first rank's
        assert placed is not None and placed.worker_id == "b" and placed.predicted_cached_tokens == 0

    asyncio.run(run())


def test_dead_replica_never_chosen_and_forgotten() -> None:
    """A replica reported dead leaves the candidates and the local index."""
    tokens = prompt(4)

    async def run() -> None:
        router = _router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        router.core.index = index_with(tokens, {"a": "LLLL", "b": ""})
        router.on_replica_actor_died(a.replica_id)
        assert router.core.index.worker("a") is None
        for i in range(3):
            chosen = await asyncio.wait_for(
                serve_internals.route_one(router, _pending(tokens, f"r{i}")), 5
            )
            assert chosen.name == "b"
        router.update_replicas([b])  # removal through a replica-set update
        assert router.core.index.worker("b") is not None

    asyncio.run(run())


def test_replica_left_the_set_is_forgotten() -> None:
    """A replica dropped by a replica-set update is removed from the index."""
    tokens = prompt(2)

    async def run() -> None:
        router = _router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        router.core.index = index_with(tokens, {"a": "LL", "b": "LL"})
        router.update_replicas([b])
        assert router.core.index.worker("a") is None and router.core.index.worker("b") is not None

    asyncio.run(run())


def test_requests_without_tokens_still_routed() -> None:
    """Speculative routing (no request) and foreign args get a load-based ranking."""

    async def run() -> None:
        router = _router()
        replicas = [FakeReplica("a", _stats("a", queued=5000)), FakeReplica("b", _stats("b"))]
        ranks = await router.choose_replicas(replicas, None)
        assert [rank[0].name for rank in ranks] == ["b", "a"]
        meta = _SERVE.RequestMetadata(request_id="x", internal_request_id="x")
        other = PendingRequest(args=["raw"], kwargs={}, metadata=meta)
        assert len(await router.choose_replicas(replicas, other)) == 2 and other.args == ["raw"]

    asyncio.run(run())


def test_routed_counted_once_per_request() -> None:
    """Retries of one request (choose_replicas again) count one routed request."""
    tokens = prompt(2)

    async def run() -> SwaPrefixRequestRouter:
        router = _router()
        replicas = [FakeReplica("a")]
        pending = _pending(tokens)
        await router.choose_replicas(replicas, pending)
        await router.choose_replicas(replicas, pending)
        return router

    router = asyncio.run(run())
    assert router.metrics.routed.labels("swa_prefix")._value.get() == 1


def test_malformed_stats_ignored() -> None:
    """A replica with broken routing stats is still a candidate, without load information."""

    async def run() -> None:
        router = _router()
        ranks = await router.choose_replicas([FakeReplica("a", {"queue_len": -1})], None)
        assert [r[0].name for r in ranks] == ["a"]

    asyncio.run(run())


class CountingSubscriber:
    """Stands in for IndexSubscriber: counts pulls, each taking one loop turn."""

    stopped = False

    def __init__(self, hang: asyncio.Event | None = None) -> None:
        self.pulls = 0
        self.reachable = True
        self._hang = hang  # a pull waits on it: an actor that does not answer

    async def sync(self, wait_s: float = 0.0) -> bool:
        self.pulls += 1
        await asyncio.sleep(0)  # one loop turn, so concurrent decisions overlap
        if self._hang is not None:
            await self._hang.wait()
        return False


def test_completion_triggers_one_shared_catch_up_pull() -> None:
    """After a completion the next decisions pull once (shared); without one they do not pull."""
    tokens = prompt(2)

    async def run() -> None:
        router = _router()
        sub = CountingSubscriber()
        router._subscribe, router._subscriber = True, sub
        replicas = [FakeReplica("a"), FakeReplica("b")]
        await router.choose_replicas(replicas, _pending(tokens, "r1"))
        assert sub.pulls == 0
        router.on_request_completed(replicas[0].replica_id, "r1")
        await asyncio.gather(
            *(router.choose_replicas(replicas, _pending(tokens, f"c{i}")) for i in range(3))
        )
        assert sub.pulls == 1
        await router.choose_replicas(replicas, _pending(tokens, "r5"))
        assert sub.pulls == 1

    asyncio.run(run())


def test_one_candidate_skips_the_catch_up_pull_until_there_are_two() -> None:
    """With one candidate the ranking cannot change, so a completion costs the next decision no
    pull (the first token's hop); the pull is owed: the first decision between two pulls once."""
    tokens = prompt(2)

    async def run() -> None:
        router = _router()
        sub = CountingSubscriber()
        router._subscribe, router._subscriber = True, sub
        one = [FakeReplica("a")]
        for i in range(3):
            router.on_request_completed(one[0].replica_id, f"r{i}")
            ranks = await router.choose_replicas(one, _pending(tokens, f"n{i}"))
            assert [r[0].name for r in ranks] == ["a"]
        assert sub.pulls == 0
        await router.choose_replicas([*one, FakeReplica("b")], _pending(tokens, "two"))
        assert sub.pulls == 1

    asyncio.run(run())


def test_sync_before_decide_pulls_even_for_one_candidate() -> None:
    """`sync_before_decide` (tests, benchmarks: exact predictions) keeps its pull per decision."""
    tokens = prompt(2)

    async def run() -> None:
        router = _router()
        sub = CountingSubscriber()
        router._subscribe, router._subscriber, router._sync_before_decide = True, sub, True
        await router.choose_replicas([FakeReplica("a")], _pending(tokens, "r1"))
        await router.choose_replicas([FakeReplica("a")], _pending(tokens, "r2"))
        assert sub.pulls == 2

    asyncio.run(run())


def test_an_unreachable_index_does_not_hold_decisions(monkeypatch) -> None:
    """The index actor's node went away: the first catch-up is bounded by a timeout, after
    which decisions use the local mirror without pulling until a pull answers again."""
    from router import serve_router

    monkeypatch.setattr(serve_router, "_CATCH_UP_TIMEOUT_S", 0.05)
    tokens = prompt(2)

    async def run() -> None:
        router = _router()
        hang = asyncio.Event()
        sub = CountingSubscriber(hang)
        router._subscribe, router._subscriber = True, sub
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router.on_request_completed(replicas[0].replica_id, "r0")
        await asyncio.wait_for(router.choose_replicas(replicas, _pending(tokens, "r1")), 10)
        assert sub.pulls == 1 and not sub.reachable
        router.on_request_completed(replicas[0].replica_id, "r1")
        await asyncio.wait_for(router.choose_replicas(replicas, _pending(tokens, "r2")), 10)
        assert sub.pulls == 1  # not tried again while unreachable
        hang.set()

    asyncio.run(run())


def test_a_completion_the_ingress_noted_stops_counting_as_load_at_once() -> None:
    """The ingress notes a finished request before Serve reports it: the next decision no
    longer counts it as in-flight load on its worker (a sequential client keeps its cache hit)."""
    tokens = prompt(4)

    async def run() -> None:
        router = _router()
        router.core.index = index_with(tokens, {"a": "LLLL", "b": ""})
        replicas = [FakeReplica("a", _stats("a")), FakeReplica("b", _stats("b"))]
        await router.choose_replicas(replicas, _pending(tokens, "first"))
        assert router.core.inflight.unsampled("a", None)[1] == 1
        routing_record.note_finished("first")
        await router.choose_replicas(replicas, _pending(tokens, "second"))
        assert router.core.inflight.unsampled("a", None)[1] == 1  # only "second" is in flight now

    asyncio.run(run())


def test_finished_cursor_returns_each_id_once() -> None:
    start = routing_record.cursor()
    routing_record.note_finished("x1")
    routing_record.note_finished("x2")
    ids, end = routing_record.finished_since(start)
    assert ids == ["x1", "x2"] and end == start + 2
    assert routing_record.finished_since(end) == ([], end)


def test_an_unreachable_replica_ranks_last_until_its_suspicion_expires(monkeypatch) -> None:
    """Serve could not reach "a" (its node went away): "a" keeps the cache hit but ranks last,
    so new requests and retries go elsewhere before the controller drops it."""
    from router import serve_router

    tokens = prompt(4)
    clock = [1000.0]
    monkeypatch.setattr(serve_router.time, "monotonic", lambda: clock[0])

    async def ranks(router: SwaPrefixRequestRouter, rid: str) -> list[str]:
        replicas = [FakeReplica("a", _stats("a")), FakeReplica("b", _stats("b"))]
        return [rank[0].name for rank in await router.choose_replicas(replicas, _pending(tokens, rid))]

    async def run() -> None:
        router = _router()
        router.core.index = index_with(tokens, {"a": "LLLL", "b": ""})
        assert await ranks(router, "r1") == ["a", "b"]
        router.on_replica_actor_unavailable(FakeReplica("a").replica_id)
        assert await ranks(router, "r2") == ["b", "a"]
        clock[0] += serve_router._SUSPECT_S + 0.1
        assert await ranks(router, "r3") == ["a", "b"]

    asyncio.run(run())


def test_the_replica_serve_routed_to_is_noted_for_the_ingress() -> None:
    async def run() -> None:
        router = _router()
        pending = _pending(prompt(2), "placed-1")
        router.on_request_routed(pending, FakeReplica("b").replica_id, None)

    asyncio.run(run())
    placed = routing_record.placement_of("placed-1")
    assert placed is not None and placed.worker_id == "b"
    assert routing_record.placement_of("never-routed") is None


def test_a_pinned_call_goes_to_its_replica_only_or_to_any_when_it_is_gone() -> None:
    """A delta channel (`router.pinned.PinnedCall`) is routed with no decision: to the replica it
    names alone; when that one is not a candidate, to every candidate (the one that gets it
    refuses it, so the call fails instead of Serve waiting for a replica that is gone)."""

    async def run() -> None:
        router = _router()
        replicas = [FakeReplica("a"), FakeReplica("b")]
        meta = _SERVE.RequestMetadata(request_id="ch", internal_request_id="ch")
        pinned = PendingRequest(args=[PinnedCall("b")], kwargs={}, metadata=meta)
        assert [[r.name for r in rank] for rank in await router.choose_replicas(replicas, pinned)] == [["b"]]
        gone = PendingRequest(args=[PinnedCall("c")], kwargs={}, metadata=meta)
        ranks = await router.choose_replicas(replicas, gone)
        assert [[r.name for r in rank] for rank in ranks] == [["a", "b"]]
        router.on_request_routed(pinned, replicas[1].replica_id, None)  # no decision to record
        assert routing_record.placement_of("ch") is None

    asyncio.run(run())
