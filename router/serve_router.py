"""The Ray Serve `RequestRouter` for the worker deployment: a thin adapter over `RouterCore`.

Opt the worker deployment in with (YAML `request_router_config` takes the same keys)::

    RequestRouterConfig(
        request_router_class="router.serve_router:SwaPrefixRequestRouter",
        request_router_kwargs={"policy": "swa_prefix"},
        request_routing_stats_period_s=1.0,
    )

A call whose first argument is a `router.pinned.PinnedCall` (the ingress's delta channel to
one worker replica) goes to that replica only, with no decision.

Per request: read `pending_request.args[0]` (a `RoutedRequest`), turn the candidate replicas into
`Candidate(worker_id=replica unique id, load=parsed routing_stats)`, rank them and return one
replica per rank, so Serve tries them strictly in order (it skips a rank whose replica is at
`max_ongoing_requests`). When Serve says which replica took the request (`on_request_routed`),
the decision's prediction for that replica goes into this process's routing record
(`router/routing_record.py`), where the ingress reads it.

NOTE: Serve pickles this module *by value* into every caller process; keep no shared state in
module globals here. Shared things (metrics registry, routing record, transport) live in other
modules, which are pickled by reference and imported normally.
NOTE: no `FIFOMixin`: a decision is made for one request's tokens, so the chosen replica must
go to that request (the base class matches by internal request id); FIFO would hand it to
whichever request is oldest. No `LocalityMixin` either: same-node preference would override
the cache decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster import transport
from cluster.index import ClusterIndex, IndexLimits
from cluster.messages import RoutedRequest, WorkerLoad, WorkerRemoved
from core.events import ROOT_HASH
from router import metrics as router_metrics
from router import routing_record
from router.core import Candidate, RouterCore, RoutingDecision
from router.cost import CostWeights
from router.pinned import PinnedCall
from router.policies import DEFAULT_POLICY, make_policy

logger = logging.getLogger(__name__)

_MAX_TRACKED_KEYS = 4096  # request ids remembered for early completions, decisions not yet placed
_LOOKUP_INTERVAL_S = 1.0  # how often a router without an index actor looks for one
# A replica Serve found unreachable ranks last for this long (or until Serve drops it): a node
# that went away answers nothing until the controller notices, which takes several seconds.
_SUSPECT_S = 10.0
# A catch-up pull takes about a millisecond; one that takes this long meets an actor that is not
# answering, and the decision goes on without it.
_CATCH_UP_TIMEOUT_S = 2.0


class SwaPrefixRequestRouter(RequestRouter):
    """Routes on the SWA-valid prefix match; `policy` picks one of router.policies.POLICIES."""

    def initialize_state(
        self,
        policy: str = DEFAULT_POLICY,
        cost_weights: dict[str, float] | None = None,
        max_pages_per_worker: int = IndexLimits.max_pages_per_worker,
        index_actor_name: str | None = None,
        subscribe: bool = True,
        pull_wait_s: float = 1.0,
        bootstrap_timeout_s: float = 2.0,
        sync_before_decide: bool = False,
        **_: Any,
    ) -> None:
        """Called once by Serve with `request_router_kwargs` (all JSON values).

        Args:
            policy: swa_prefix | prefix | least_loaded | round_robin.
            cost_weights: overrides of `router.cost.CostWeights` fields.
            max_pages_per_worker: memory bound of the local index per worker.
            index_actor_name: defaults to the worker deployment's own index actor.
            subscribe: False keeps the index local (offline tests fill `self.core.index`).
            pull_wait_s: long-poll wait of the index subscriber.
            bootstrap_timeout_s: how long the first decision waits for the first pull.
            sync_before_decide: pull once before every decision (exact even right after a
                push, at the cost of one actor round trip per request; for tests and benches).
        """
        index = ClusterIndex(IndexLimits(max_pages_per_worker=max_pages_per_worker))
        self.core = RouterCore(index, make_policy(policy, CostWeights(**(cost_weights or {}))))
        self.metrics = router_metrics.default_metrics()
        # None: the deployment's own index actor, named from the first candidate's replica id
        # (the base class keeps its deployment id only as a private attribute).
        self._actor_name: str | None = index_actor_name
        self._subscribe = subscribe
        self._pull_wait_s = pull_wait_s
        self._bootstrap_timeout_s = bootstrap_timeout_s
        self._sync_before_decide = sync_before_decide
        self._actor: ray.actor.ActorHandle | None = None
        self._subscriber: transport.IndexSubscriber | None = None
        self._next_lookup = 0.0  # monotonic time of the next index-actor lookup
        # Catch-up pulls (see `_catch_up`): completions seen, completions covered by a pull.
        self._completions = 0
        self._synced = 0
        self._sync_task: asyncio.Task[None] | None = None
        self._counted: OrderedDict[str, None] = OrderedDict()  # requests already counted
        # RoutedRequest.request_id -> the in-flight key, for completions the ingress notes
        # before Serve reports them (router/routing_record.py).
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._finished_cursor = routing_record.cursor()
        # in-flight key -> its last decision, until Serve says which replica took the request
        self._decisions: OrderedDict[str, RoutingDecision] = OrderedDict()
        # worker id → (the routing_stats dict last parsed, its parse); Serve replaces the dict
        # when a new sample arrives, so identity tells whether to parse again.
        self._loads: dict[str, tuple[object, WorkerLoad | None]] = {}
        self._suspect: dict[str, float] = {}  # worker id -> monotonic time it stops being suspect

    # ---- the decision ----------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pinned = _pinned(pending_request)
        if pinned is not None:
            return _pin(pinned, candidate_replicas)
        if self._actor_name is None:
            dep = candidate_replicas[0].replica_id.deployment_id
            self._actor_name = transport.index_actor_name(dep.app_name, dep.name)
        await self._ensure_fresh(self._actor_name, catch_up=len(candidate_replicas) > 1)
        request = _routed_request(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [Candidate(wid, self._load(wid, r)) for wid, r in by_id.items()]
        key = pending_request.metadata.internal_request_id if pending_request else None
        start = time.perf_counter()
        decision = self.core.decide(
            request.token_ids if request else [],
            candidates,
            max_new_tokens=request.max_new_tokens if request else 0,
            request_key=key if request else None,
            avoid=(*(request.avoid if request else ()), *self._suspects()),
            root_hash=_root_hash(request),
        )
        elapsed = time.perf_counter() - start
        if request is not None and key is not None:
            self._count_once(key, elapsed)
            if request.request_id:
                _remember(self._keys, request.request_id, key)
                _remember(self._decisions, key, decision)
        return [[by_id[r.worker_id]] for r in decision.ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Serve's choice may be a lower rank than ours (the first was full): move the
        request's in-flight and pending records to the replica that took it, and note the
        placement with its prediction for the ingress (its headers and metrics; its retry avoids
        that replica if it dies before answering)."""
        request = _routed_request(pending_request)
        if request is not None:
            key = pending_request.metadata.internal_request_id
            worker_id = replica_id.unique_id
            self.core.placed(key, request.token_ids, worker_id, root_hash=_root_hash(request))
            if request.request_id:
                placement = self._placement(self._decisions.pop(key, None), worker_id)
                routing_record.note_placed(request.request_id, placement)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.core.complete(internal_request_id)
        # The worker published this request's cache events before finishing it (the worker
        # deployment's contract), so the actor holds them now: the next decision pulls first.
        self._completions += 1

    # ---- replica set -----------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = {rid.unique_id for rid in self.curr_replicas}
        super().update_replicas(replicas)
        after = {r.replica_id.unique_id for r in replicas}
        for worker_id in before - after:
            self._forget(worker_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        """Serve could not reach the replica (its node may be gone): rank it last for a while,
        so retries and new requests go to the others instead of waiting out the controller."""
        super().on_replica_actor_unavailable(replica_id)
        self._suspect[replica_id.unique_id] = time.monotonic() + _SUSPECT_S

    def _forget(self, worker_id: str) -> None:
        """A replica left: drop it locally and tell the shared index (fire and forget)."""
        self.core.index.remove(worker_id)
        self.core.forget_worker(worker_id)
        self._loads.pop(worker_id, None)
        self._suspect.pop(worker_id, None)
        if (
            self._actor is not None
            and self._subscriber is not None
            and not self._subscriber.stopped
        ):
            self._actor.remove.remote(WorkerRemoved(worker_id))

    # ---- helpers ---------------------------------------------------------------------------
    def _take_ingress_completions(self) -> None:
        """Completions the ingress already saw count now, before Serve reports them."""
        ids, self._finished_cursor = routing_record.finished_since(self._finished_cursor)
        if not ids:
            return
        for request_id in ids:
            key = self._keys.pop(request_id, None)
            if key is not None:
                self.core.complete(key)
        self._completions += 1  # their cache events are at the actor: pull before deciding

    async def _ensure_fresh(self, actor_name: str, catch_up: bool = True) -> None:
        """Follow the index actor: start (or restart) the subscriber, or pull once if asked.

        `catch_up` False (one candidate): the catch-up pull after a completion is skipped, since
        the ranking of one replica is that replica whatever the index says. It is owed, not
        dropped: the next decision between several replicas pulls first. What the skip can cost
        is the prediction only (headers, `swaserve_router_predictions_total`), and only when
        the request outran the long poll (~1 ms after the finished request's push).
        """
        self._take_ingress_completions()
        if not self._subscribe:
            return
        sub = self._subscriber
        if sub is not None and not sub.stopped:
            if self._sync_before_decide:
                self._completions += 1
            elif not catch_up:
                return
            await self._catch_up(self._completions)
            return
        if time.monotonic() < self._next_lookup or not ray.is_initialized():
            return
        self._next_lookup = time.monotonic() + _LOOKUP_INTERVAL_S
        # NOTE: blocking GCS calls, once per router (or once a second while the actor is gone),
        # run in a thread; every call to the actor itself is awaited. The first router may
        # create the actor before any worker does (requests can arrive before a worker's first
        # flush); once a followed actor was killed (application shut down) it is only looked up.
        lookup = transport.get_or_create_index_actor if sub is None else transport.find_index_actor
        actor = await asyncio.to_thread(lookup, actor_name)
        if actor is None:
            return
        self._actor = actor
        sub = self._subscriber = transport.IndexSubscriber(
            actor, self.core.index, self._pull_wait_s
        )
        sub.start()
        if not await sub.wait_ready(self._bootstrap_timeout_s):
            logger.warning("cache index not reached in %.1fs", self._bootstrap_timeout_s)

    async def _catch_up(self, target: int) -> None:
        """Make sure a pull that started after completion number `target` has been applied.

        The long poll alone delivers a push within about a millisecond, but a follow-up request
        can reach the router sooner (a driver calling in a loop). After a completion, the next
        decision therefore pulls once (a non-waiting actor call, ~1 ms); concurrent decisions
        share one pull, and decisions with no completion since the last pull pull nothing.
        """
        while self._synced < target:
            sub = self._subscriber
            if sub is None or not sub.reachable:
                # The actor is down or restarting (its node went away): decide on the mirror
                # as it is rather than stall every decision; the long poll catches up later.
                self._synced = target
                return
            task = self._sync_task
            if task is None or task.done():
                task = self._sync_task = asyncio.get_running_loop().create_task(self._pull_once())
            try:
                await asyncio.wait_for(asyncio.shield(task), _CATCH_UP_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("cache index catch-up pull took over %.1fs; deciding without it",
                               _CATCH_UP_TIMEOUT_S)  # fmt: skip
                sub.reachable = False  # until a pull answers again

    async def _pull_once(self) -> None:
        started = self._completions
        try:
            if self._subscriber is not None:
                await self._subscriber.sync()
        except Exception as exc:  # best effort: the long poll keeps following
            logger.warning("cache index catch-up pull failed: %s", exc)
        self._synced = max(self._synced, started)

    def _suspects(self) -> tuple[str, ...]:
        if not self._suspect:
            return ()
        now = time.monotonic()
        for worker_id in [w for w, until in self._suspect.items() if until <= now]:
            del self._suspect[worker_id]
        return tuple(self._suspect)

    def _load(self, worker_id: str, replica: RunningReplica) -> WorkerLoad | None:
        stats = replica.routing_stats
        cached = self._loads.get(worker_id)
        if cached is not None and cached[0] is stats:
            return cached[1]
        try:
            load = WorkerLoad.from_routing_stats(stats)
        except ValueError as exc:
            logger.warning("ignoring routing stats of %s: %s", replica.replica_id, exc)
            load = None
        self._loads[worker_id] = (stats, load)
        return load

    def _placement(
        self, decision: RoutingDecision | None, worker_id: str
    ) -> routing_record.Placement:
        ranked = decision.ranked_for(worker_id) if decision is not None else None
        policy = decision.policy if decision is not None else self.core.policy.name
        if ranked is None:
            return routing_record.Placement(worker_id, policy)
        return routing_record.Placement(
            worker_id, policy, ranked.predicted_cached_tokens, ranked.predicted_repaired_tokens,
            ranked.predicted_loaded_tokens,
        )  # fmt: skip

    def _count_once(self, key: str, elapsed: float) -> None:
        if key in self._counted:
            return
        _remember(self._counted, key, None)
        self.metrics.observe_decision(self.core.policy.name, elapsed)


def _remember(kept: OrderedDict[str, Any], key: str, value: Any) -> None:
    """`kept[key] = value`, newest last, the oldest dropped past `_MAX_TRACKED_KEYS`."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > _MAX_TRACKED_KEYS:
        kept.popitem(last=False)


def _routed_request(pending_request: PendingRequest | None) -> RoutedRequest | None:
    """The request's `RoutedRequest`; None for speculative routing or foreign callers."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RoutedRequest) else None


def _pinned(pending_request: PendingRequest | None) -> PinnedCall | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, PinnedCall) else None


def _pin(call: PinnedCall, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    """The named replica alone; when it is not a candidate, every candidate (the one that gets
    the call refuses it: `router.pinned`). NOTE: returning no replica would make Serve retry,
    backing off, until the replica came back, which a dead one never does."""
    named = [r for r in candidates if r.replica_id.unique_id == call.replica_id]
    return [named] if named else [candidates]


def _root_hash(request: RoutedRequest | None) -> int:
    """Where the request's page-hash chain starts: its cache salt's (docs/design.md §9.10)."""
    params = request.params if request is not None else None
    return ROOT_HASH if params is None else params.root_hash
