"""Cache events over Ray: worker replicas push to one named index actor, routers follow its log.

Why a named index actor rather than routers pulling from each replica:
- Workers pay one push per drained batch (a frame on the actor's event socket,
  `cluster/event_socket.py`, or an actor call where there is none), however many routers exist (one router per
  ingress replica, docs/design.md §14); pulling from replicas would cost N routers × M
  replicas calls and a per-router backlog inside every replica's event loop, next to the engine.
- Gap detection and the "send a snapshot" answer live in one place; the replica keeps no
  per-consumer state and never serves bootstrap snapshots to routers (the hub rebuilds them).
- A router that starts late, or falls behind the bounded log, bootstraps from the actor's index
  without touching any replica.
- Serve replicas only answer their deployment's methods; a side channel to a specific replica
  would need the replica actor's handle, which routers do not get.
The cost is one hop (worker → actor → router, about 1 ms on loopback) and one actor process
per worker deployment. Pushes and the log's deltas to the routers travel on the actor's event
socket (`cluster/event_socket.py`; a Ray call costs each side ~0.4–0.7 ms of CPU), with actor
calls where it cannot be reached (pushes; routers long-poll `pull(wait_s)`), so a push reaches
every router at once.

Lifecycle: the actor is detached, named `index_actor_name(app, deployment)` in namespace
`swaserve`, created by whichever comes first, a worker replica or a router's first decision
(`get_or_create_index_actor`, idempotent); a router whose actor was killed only looks it up
again (`find_index_actor`), so it never resurrects the actor of an application shut down. Ray restarts it if it dies (`max_restarts=-1`) with a fresh
`epoch`: publishers get "resync needed" on their next push, routers a reset delta.
`kill_index_actor` ends it (the app's shutdown calls it); subscribers then stop following.
NOTE: the three lookups are blocking GCS calls; async code runs them with `asyncio.to_thread`
(tests/test_architecture.py fails on a direct call inside an `async def`).

The actor also keeps each worker replica's latest stats sample (`cluster.replica_stats`), which
the ingress reads for `/metrics` and `/health` (`report_stats` / `replica_stats`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayError

from cluster.event_socket import (
    UNREACHABLE_S,
    Endpoint,
    EventSocketClient,
    EventSocketFollower,
    EventSocketServer,
)
from cluster.index import ClusterIndex, IndexLimits
from cluster.index_hub import IndexHub, apply_delta
from cluster.messages import (
    CacheSnapshot,
    Delta,
    EventBatch,
    PushAck,
    StatsDict,
    StatsRefresh,
    WorkerMeta,
    WorkerRemoved,
    WorkerResync,
)
from cluster.replica_stats import ReplicaSnapshot, ReplicaStatsBoard

logger = logging.getLogger(__name__)

INDEX_NAMESPACE = "swaserve"


def index_actor_name(app_name: str, deployment_name: str) -> str:
    """The index actor of one worker deployment (workers and routers derive the same name)."""
    return f"swaserve-cache-index:{app_name}:{deployment_name}"


PULL_THREADS = 64  # long polls waiting at once; more wait for a thread (< wait_s, or a push)


class CacheIndexActor:
    """The Ray actor around `IndexHub` (and the replicas' `ReplicaStatsBoard`).

    A threaded actor, not an async one: Ray runs an async actor's every call through its event
    loop from the thread that received it, a hop that cost ~300 µs of the actor's CPU per call
    on top of ~430 µs for the call itself (a trivial method, 2-core machine); every worker push
    and router pull is a call (`swaserve bench index-actor`). Updates and reads run in the
    default concurrency group, one at a time; pulls in the group `pulls`, whose threads may
    block in a long poll (`wait_s`), so a waiting router never holds up a push. The event
    socket's threads (`event_endpoint`) push and stream the log the same way. One lock guards
    the hub and the board: a pull reads the log while the next push appends to it."""

    def __init__(self, max_pages_per_worker: int, max_workers: int, max_log: int) -> None:
        self._hub = IndexHub(IndexLimits(max_pages_per_worker, max_workers), max_log)
        self._stats = ReplicaStatsBoard()
        self._changed = threading.Condition()  # its lock guards the hub and the board
        self._socket: EventSocketServer | None = None
        self._socket_failed = False

    def event_endpoint(self) -> Endpoint | None:
        """Where worker replicas push and routers follow the log on a socket
        (`cluster.event_socket`), opened on the first call; None when it cannot be opened (both
        stay actor calls)."""
        with self._changed:
            if self._socket is None and not self._socket_failed:
                try:
                    host = str(ray.util.get_node_ip_address())
                    self._socket = EventSocketServer(host, self._socket_push, self._pull)
                    logger.info("cache index: event socket on %s:%d", *self._socket.endpoint[:2])
                except OSError as e:
                    self._socket_failed = True
                    logger.warning("cache index: no event socket (%s); pushes stay actor calls", e)
            return self._socket.endpoint if self._socket is not None else None

    def push(self, batch: EventBatch, stats: StatsDict | None = None) -> PushAck:
        """Apply a batch of cache events, and keep the replica's stats sample sent with it (a
        refresh, as `report_stats(register=False)`)."""
        with self._changed:
            ack = self._hub.push(batch)
            self._changed.notify_all()
            if stats is not None:
                self._stats.report(batch.worker_id, batch.incarnation, stats, register=False)
        return ack

    def _socket_push(self, batch: EventBatch | StatsRefresh, stats: StatsDict | None) -> bool:
        """A pusher's frame (`cluster.event_socket`): True when the worker must resync."""
        if isinstance(batch, StatsRefresh):
            if stats is not None:
                self.report_stats(batch.worker_id, batch.incarnation, stats, register=False)
            return False
        return self.push(batch, stats).resync_needed

    def resync(self, update: WorkerResync) -> PushAck:
        with self._changed:
            ack = self._hub.resync(update)
            self._changed.notify_all()
        return ack

    def remove(self, update: WorkerRemoved) -> bool:
        with self._changed:
            self._stats.remove(update.worker_id, update.incarnation)
            changed = self._hub.remove(update)
            self._changed.notify_all()
        return changed

    def report_stats(self, worker_id: str, incarnation: str, stats: StatsDict, register: bool) -> bool:
        """Keep the sample; True when the index lacks this incarnation (after this actor
        restarted, an idle replica learns here that it must resync)."""
        with self._changed:
            self._stats.report(worker_id, incarnation, stats, register=register)
            entry = self._hub.index.worker(worker_id)
            return entry is None or entry.stale or entry.meta.incarnation != incarnation

    def replica_stats(self, stale_after_s: float, forget_after_s: float) -> ReplicaSnapshot:
        """Every worker replica's latest stats (None: silent for over `stale_after_s`)."""
        with self._changed:
            return self._stats.snapshot(stale_after_s, forget_after_s)

    @ray.method(concurrency_group="pulls")
    def pull(self, epoch: str | None, cursor: int, wait_s: float = 0.0) -> Delta | None:
        """Updates after `cursor`, waiting up to `wait_s` for one when there are none yet."""
        return self._pull(epoch, cursor, wait_s)

    def _pull(self, epoch: str | None, cursor: int, wait_s: float) -> Delta | None:
        with self._changed:  # no update between the look and the wait: no lost wakeup
            delta = self._hub.pull(epoch, cursor)
            if delta is None and wait_s > 0:
                self._changed.wait(wait_s)
                delta = self._hub.pull(epoch, cursor)
        return delta

    def describe(self) -> dict[str, object]:
        """Workers (id → incarnation, seq, stale, pages), log bounds and the node the actor runs
        on, for tests and debugging."""
        with self._changed:
            workers = {
                e.meta.worker_id: (e.meta.incarnation, e.seq, e.stale, len(e.pages))
                for e in self._hub.index.workers()
            }
            epoch, end = self._hub.epoch, self._hub.end
        node = ray.get_runtime_context().get_node_id()
        return {"epoch": epoch, "end": end, "workers": workers, "node_id": node}


def get_or_create_index_actor(
    name: str,
    *,
    limits: IndexLimits | None = None,
    max_log: int = 4096,
) -> ActorHandle:
    """The named index actor, created on first use (idempotent across processes)."""
    limits = limits or IndexLimits()
    remote_cls = ray.remote(concurrency_groups={"pulls": PULL_THREADS})(CacheIndexActor)  # type: ignore[call-overload]  # not in Ray's stubs
    head = _head_node_id()
    strategy: Any = "DEFAULT"
    if head is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the head node, which lives as long as the cluster: a worker node that goes away
        # takes no index with it, and Ray restarts a killed actor there. NOTE: not soft: Ray
        # places a soft-affine zero-CPU actor on any node (tests/deploy/test_chaos.py checks).
        strategy = NodeAffinitySchedulingStrategy(node_id=head, soft=False)
    actor = remote_cls.options(
        name=name,
        namespace=INDEX_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        # NOTE: outside the creating replica's placement group (Serve captures a replica's child
        # actors into it; an explicit strategy opts out): a tensor-parallel replica's group goes
        # away with the replica, and a detached actor scheduled there could never restart
        # (docs/design.md §17.4).
        scheduling_strategy=strategy,
    ).remote(limits.max_pages_per_worker, limits.max_workers, max_log)
    return cast(ActorHandle, actor)  # Ray's stubs type .remote() of a class as a union


def _head_node_id() -> str | None:
    """The alive head node's id (Ray marks it with the `node:__internal_head__` resource)."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def find_index_actor(name: str) -> ActorHandle | None:
    """The index actor if it exists (routers look it up; only workers create it, so a router
    never resurrects the actor of an application that was shut down)."""
    try:
        return ray.get_actor(name, namespace=INDEX_NAMESPACE)
    except ValueError:
        return None


def kill_index_actor(name: str) -> bool:
    """End the index actor; False when it did not exist."""
    try:
        actor = ray.get_actor(name, namespace=INDEX_NAMESPACE)
    except ValueError:
        return False
    ray.kill(actor, no_restart=True)
    return True


class EventPublisher:
    """Worker side: push this replica's event batches, resyncing from a snapshot when asked.

    `snapshot_fn` returns the engine's whole cache labelled with the seq of the last batch its
    state includes (a snapshot newer than the last published batch is fine: batches at or below
    its seq are then ignored). It runs in a worker thread (`asyncio.to_thread`, inside
    `start`/`publish`), so it may block until the engine's current step ends.
    Calls are serialised, so batches reach the actor in seq order.
    """

    def __init__(
        self, actor: ActorHandle, meta: WorkerMeta, snapshot_fn: Callable[[], CacheSnapshot]
    ) -> None:
        self._actor = actor
        self.meta = meta
        self._snapshot_fn = snapshot_fn
        self._lock = asyncio.Lock()
        self._needs_resync = True
        self.resyncs = 0  # snapshots sent (observability)
        self._client: EventSocketClient | None = None  # pushes go here once connected
        self._no_socket_until = 0.0  # monotonic: actor calls until then (could not connect)
        self.socket_pushes = 0  # (observability)
        self.socket_refreshes = 0  # stats samples alone on the socket (observability)

    async def start(self) -> None:
        """Register this incarnation (metadata + current snapshot, seq 0 on a fresh engine)."""
        async with self._lock:
            await self._resync()

    async def publish(self, batch: EventBatch, stats: StatsDict | None = None) -> None:
        """Push one drained batch (with a stats sample to refresh, when given); returns once the
        index actor applied it.

        NOTE: await this for the batch holding a finished request's events *before* returning
        that request's response: then the next request's prediction sees them (routers hear of
        a push within about a millisecond through their long poll).
        """
        if (batch.worker_id, batch.incarnation) != (self.meta.worker_id, self.meta.incarnation):
            raise ValueError(
                f"batch of {batch.worker_id}/{batch.incarnation} given to the publisher of "
                f"{self.meta.worker_id}/{self.meta.incarnation}"
            )
        async with self._lock:
            if self._needs_resync:
                await self._resync()
                if stats is not None:
                    await self._refresh(stats)
                return  # the snapshot already holds this batch's state
            try:
                resync_needed = await self._push(batch, stats)
            except RayError as exc:
                logger.warning("cache index push failed (%s); resyncing on the next batch", exc)
                self._needs_resync = True
                return
            except (OSError, EOFError) as exc:  # the socket: whether the actor applied it is unknown
                logger.warning("cache index event socket failed (%s); resyncing", exc)
                self._drop_socket()
                resync_needed = True
            if resync_needed:
                await self._resync()

    async def _push(self, batch: EventBatch, stats: StatsDict | None) -> bool:
        """One push on the event socket (`cluster.event_socket`), or as an actor call when there
        is none; True when the actor asks for a resync."""
        client = await self._socket_client()
        if client is None:
            ack: PushAck = await self._actor.push.remote(batch, stats)
            return ack.resync_needed
        resync_needed = await client.push(batch, stats)
        self.socket_pushes += 1
        return resync_needed

    async def _socket_client(self) -> EventSocketClient | None:
        if self._client is not None or time.monotonic() < self._no_socket_until:
            return self._client
        endpoint: Endpoint | None = await self._actor.event_endpoint.remote()
        try:
            if endpoint is None:
                raise ConnectionRefusedError("the index actor opened no event socket")
            self._client = await EventSocketClient.connect(endpoint)
        except OSError as exc:
            logger.warning("cache index event socket not reached (%s); pushing by actor calls for "
                           "%.0f s", exc, UNREACHABLE_S)  # fmt: skip
            self._no_socket_until = time.monotonic() + UNREACHABLE_S
        return self._client

    def _drop_socket(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    async def refresh_stats(self, stats: StatsDict) -> None:
        """Send a stats sample with no cache event to go with it (`/metrics`, `/health`; a
        refresh, as `report_stats(register=False)`): a frame on the event socket, in order with
        the pushes; an actor call when there is no socket. Best effort."""
        async with self._lock:
            await self._refresh(stats)

    async def _refresh(self, stats: StatsDict) -> None:
        try:
            client = await self._socket_client()
        except RayError as exc:
            logger.debug("stats report to the cache index failed: %s", exc)
            return
        if client is not None:
            try:
                await client.push(StatsRefresh(self.meta.worker_id, self.meta.incarnation), stats)
                self.socket_refreshes += 1
                return
            except (OSError, EOFError) as exc:  # no batch in it: nothing to resync for
                logger.warning("cache index event socket failed (%s); reconnecting at the next push", exc)
                self._drop_socket()
        await self.report_stats(stats, register=False)

    async def report_stats(self, stats: StatsDict, *, register: bool) -> None:
        """Send one stats sample for `/metrics` and `/health` (`register`: see
        `cluster.replica_stats`); best effort, a failure is only logged. A registering report
        that the index does not know (the actor restarted meanwhile) resyncs at once, so an
        idle replica is back in the index within a stats period."""
        try:
            missing: bool = await self._actor.report_stats.remote(
                self.meta.worker_id, self.meta.incarnation, stats, register
            )
        except RayError as exc:
            logger.debug("stats report to the cache index failed: %s", exc)
            return
        if missing and register:
            async with self._lock:
                await self._resync()

    async def close(self) -> None:
        """Remove this incarnation from the index (graceful replica shutdown)."""
        self._drop_socket()
        try:
            await self._actor.remove.remote(self._removal())
        except RayError as exc:
            logger.warning("cache index remove failed: %s", exc)

    def close_nowait(self) -> None:
        """`close` without waiting for the answer (from synchronous shutdown code)."""
        self._drop_socket()
        self._actor.remove.remote(self._removal())

    def _removal(self) -> WorkerRemoved:
        return WorkerRemoved(self.meta.worker_id, self.meta.incarnation)

    async def _resync(self) -> None:
        snapshot = await asyncio.to_thread(self._snapshot_fn)
        await self._send(WorkerResync(self.meta, snapshot))

    async def _send(self, update: WorkerResync) -> None:
        try:
            ack: PushAck = await self._actor.resync.remote(update)
        except RayError as exc:
            logger.warning("cache index resync failed (%s); retrying on the next batch", exc)
            self._needs_resync = True
            return
        self.resyncs += 1
        self._needs_resync = ack.resync_needed


class IndexSubscriber:
    """Router side: keep a local `ClusterIndex` current by long-polling the index actor."""

    def __init__(self, actor: ActorHandle, index: ClusterIndex, wait_s: float = 1.0) -> None:
        self._actor = actor
        self.index = index
        self._wait_s = wait_s
        self._epoch: str | None = None
        self._cursor = 0
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.reachable = True  # the last pull answered (False: failed or timed out since)
        self._no_socket_until = 0.0  # monotonic: long polls until then (could not connect)
        self.socket_deltas = 0  # deltas that came on the event socket (observability)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def stopped(self) -> bool:
        """The long-poll loop ended (the actor was killed, or Ray shut down)."""
        return self._task is not None and self._task.done()

    async def sync(self, wait_s: float = 0.0) -> bool:
        """Pull and apply once; True when the index changed."""
        try:
            delta: Delta | None = await self._actor.pull.remote(self._epoch, self._cursor, wait_s)
        except Exception:
            self.reachable = False
            raise
        self.reachable = True
        changed = delta is not None and self._apply(delta)
        self._ready.set()
        return changed

    def start(self) -> asyncio.Task[None]:
        """Run the long-poll loop on the current event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._task

    async def wait_ready(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        # NOTE: stop with Ray: touching the core worker after ray.shutdown() ends the process.
        while ray.is_initialized():
            try:
                await self.sync(self._wait_s)
                backoff = 0.05
                # Then the actor's log as it grows, on its event socket, until that fails (the
                # actor restarted, or died: the next long poll tells which) or is not there.
                await self._follow()
            except ActorDiedError:
                logger.info("cache index actor is gone (application shut down): stop following")
                return
            except RayError as exc:
                logger.warning("cache index pull failed (%s); retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _follow(self) -> None:
        """Apply every delta the actor's event socket streams (`cluster.event_socket`), until
        the connection ends; at once when there is no socket to follow."""
        if time.monotonic() < self._no_socket_until:
            return
        endpoint: Endpoint | None = await self._actor.event_endpoint.remote()
        try:
            if endpoint is None:
                raise ConnectionRefusedError("the index actor opened no event socket")
            follower = await EventSocketFollower.connect(endpoint, self._epoch, self._cursor)
        except (OSError, EOFError, PermissionError) as exc:
            logger.warning("cache index event socket not followed (%s); long polls for %.0f s",
                           exc, UNREACHABLE_S)  # fmt: skip
            self._no_socket_until = time.monotonic() + UNREACHABLE_S
            return
        try:
            while True:
                delta = await follower.next()
                if delta is not None:
                    self.socket_deltas += 1
                    self._apply(delta)
                self.reachable = True
        except Exception as exc:  # noqa: BLE001 - the long poll takes over, and tells a dead actor
            logger.info("cache index event socket ended (%s); back to a long poll", exc)
        finally:
            follower.close()

    def _apply(self, delta: Delta) -> bool:
        # A delta applies from our cursor on: a reset, or a log slice that reaches past our
        # cursor. The long poll and a catch-up pull run concurrently, so one may return a slice
        # that the other's already partly covered: its unseen tail still applies (dropping it
        # would let the decision waiting on the catch-up run without the newest batch).
        if not delta.reset:
            if delta.epoch != self._epoch or not delta.since <= self._cursor < delta.cursor:
                return False
            delta = dataclasses.replace(
                delta, since=self._cursor, updates=delta.updates[self._cursor - delta.since :]
            )
        apply_delta(self.index, delta)
        self._epoch, self._cursor = delta.epoch, delta.cursor
        return True
