"""How the ingress reaches the worker deployment: request streams, model info, per-replica stats.

`WorkerClient` is the seam: `ServeWorkerClient` talks to Ray Serve, tests plug in an in-process
client around `WorkerDeployment` and a fake engine.

Per-replica stats (`/metrics`, `/health`) need *every* replica, which a `DeploymentHandle` cannot
address (it routes each call to one replica of the router's choosing). Each worker replica sends
its stats to the deployment's index actor (`cluster.replica_stats`: about every second, and when
a request starts and ends); the ingress reads all of them with one awaited actor call. Public
Ray APIs only: a named actor of our own, found by name.

A request's deltas come on the request's own call until the ingress has a delta channel open on
the replica serving it, then on that channel, one item per engine step for every request of this
ingress on the replica (`deploy/replica/channels.py`, docs/design.md §4.2); what follows holds
either way.

A request is idempotent until its first token: when the worker replica dies (or refuses it,
shutting down) before that, `ServeWorkerClient.stream` sends it again, ranking that replica last
(`RoutedRequest.avoid`), up to `RETRIES` times. The replica is the one its `StreamStart` named
or, when it died before sending one, the one the router placed the request on
(`router.routing_record.placement_of`). The `StreamStart` is held back until the first
token (or the end), so the caller only ever sees the replica that serves it, and a request that
cannot be placed fails before its HTTP status line: 503 + Retry-After.

A replica whose engine died while running the request (`EngineDiedError`, or the replica's
process gone: `RayActorError`) may have died *because* of it: a request that kills every engine
it reaches would take the replicas down one after another. So such deaths are counted per HTTP
request in a `DeathRecord` that the ingress's later restarts share (`deploy/openai/service.py`):
after the first, the request is sent once more; after the second replica, it is answered (503
with Retry-After), not sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from cluster.messages import (
    EngineDiedError,
    RoutedRequest,
    StreamStart,
    WorkerInfo,
    WorkerUnavailableError,
)
from cluster.replica_stats import ReplicaSnapshot
from core.outputs import StreamDelta
from deploy.replica.channel import DeltaBatch, OnSocket, StreamKey, Subscribe
from deploy.replica.channels import Channels, RequestItem
from deploy.replica.delta_socket import DeltaListener
from router import routing_record

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.serve.handle import DeploymentHandle

    from deploy.replica.deployment import WorkerDeployment

log = logging.getLogger("swaserve.ingress")

# A replica reports about once a second (deploy.app.ROUTING_STATS_PERIOD_S): one silent for
# 3 s is down; after 30 s (Serve's health checks have replaced it by then) it is forgotten.
STATS_STALE_AFTER_S = 3.0
STATS_FORGET_AFTER_S = 30.0
RETRIES = 2  # sends after the first, for a replica gone (or refusing) before the first token
MAX_DEATHS = 2  # replicas whose engine may die running one request; then it is answered, not sent


@dataclass
class DeathRecord:
    """The replicas whose engine died running one HTTP request (any of its prompts), across the
    client's resends and the service's restarts."""

    replicas: set[str] = field(default_factory=set)

    def note(self, replica: str | None) -> bool:
        """One more death (a replica not known: counted as a new one); True while the request
        may still be sent again."""
        self.replicas.add(replica or f"unknown-{len(self.replicas)}")
        return len(self.replicas) < MAX_DEATHS


class WorkerClient(Protocol):
    def stream(
        self, request: RoutedRequest, deaths: DeathRecord | None = None
    ) -> AsyncIterator[StreamStart | StreamDelta]: ...

    async def info(self) -> WorkerInfo: ...

    async def replica_stats(self) -> ReplicaSnapshot: ...


class ServeWorkerClient:
    """Inside the ingress replica only (imports Ray when built; the module itself does not)."""

    def __init__(
        self,
        handle: DeploymentHandle[WorkerDeployment],
        stats_timeout_s: float = 3.0,
        stale_after_s: float = STATS_STALE_AFTER_S,
        forget_after_s: float = STATS_FORGET_AFTER_S,
    ) -> None:
        from cluster.transport import index_actor_name

        self._handle = handle
        self._stream_handle: DeploymentHandle[WorkerDeployment] | None = None  # `_handles()`
        self._channel_handle: DeploymentHandle[WorkerDeployment] | None = None  # `_subscribe`
        self._channels = Channels(self._subscribe, listener=DeltaListener(_node_address))
        self._stats_timeout_s = stats_timeout_s
        self._stale_after_s = stale_after_s
        self._forget_after_s = forget_after_s
        self._info: WorkerInfo | None = None
        self._index_name = index_actor_name(handle.app_name, handle.deployment_name)
        self._index: ActorHandle | None = None

    def _handles(self) -> DeploymentHandle[WorkerDeployment]:
        """The streaming handle, made on first use on the serving loop: its router runs on this
        loop and its items come over gRPC (both cut the ingress's CPU per streamed token:
        no hop from Serve's router thread per item, no object reference per item;
        docs/design.md §4.2)."""
        if self._stream_handle is None:
            from cluster.ray_private import current_loop_handle, grpc_stream_handle

            self._handle = current_loop_handle(self._handle)
            self._stream_handle = grpc_stream_handle(self._handle, "generate")
        return self._stream_handle

    async def stream(
        self, request: RoutedRequest, deaths: DeathRecord | None = None
    ) -> AsyncIterator[StreamStart | StreamDelta]:
        """The worker stream, sent again on another replica while no token has come back (a
        replica whose engine died running it counts in `deaths`: the module docstring)."""
        deaths = deaths if deaths is not None else DeathRecord()
        for attempt in range(RETRIES + 1):
            start: StreamStart | None = None
            produced = False
            try:
                # aclosing: leaving early (client gone, stop string) must cancel the Ray stream
                # at once, which aborts the request on the worker.
                async with contextlib.aclosing(self._attempt(request)) as items:
                    async for item in items:
                        if isinstance(item, StreamStart):
                            start = item
                            if item.refusal == "unavailable" and attempt < RETRIES:
                                raise WorkerUnavailableError(item.message or "refused")
                            continue
                        if not produced and start is not None:  # first token: it serves
                            yield start
                        produced = True
                        yield item
                if not produced and start is not None:
                    yield start  # a refusal, or a stream with no delta
                return
            except Exception as e:  # noqa: BLE001 - re-raised unless the replica is gone
                if produced or attempt == RETRIES or not replica_gone(e):
                    raise
                gone = start.replica_id if start is not None else _placed_on(request.request_id)
                if engine_died(e) and not deaths.note(gone):
                    log.warning("the engines of %d replicas died running %s; not sending it again",
                                len(deaths.replicas), request.request_id)  # fmt: skip
                    raise
                log.warning("worker %s gone before the first token of %s (%s); sending again",
                            gone or "?", request.request_id, type(e).__name__)  # fmt: skip
                if gone is not None and gone not in request.avoid:
                    request = dataclasses.replace(request, avoid=(*request.avoid, gone))

    def _attempt(self, request: RoutedRequest) -> AsyncGenerator[StreamStart | StreamDelta]:
        """One send of `request`: its own call, its deltas from the replica's delta channel
        once one is open (`deploy/replica/channels.py`)."""
        return self._channels.attempt(request, functools.partial(self._call, request))

    async def _call(self, request: RoutedRequest, key: StreamKey) -> AsyncGenerator[RequestItem]:
        handle = self._handles()
        async for item in _streamed(handle, request, key):
            yield cast(RequestItem, item)

    async def _subscribe(self, sub: Subscribe) -> AsyncGenerator[DeltaBatch | OnSocket]:
        if self._channel_handle is None:
            from cluster.ray_private import grpc_stream_handle

            self._handles()  # on this loop, before the handle's first `.options()`
            self._channel_handle = grpc_stream_handle(self._handle, "deltas")
        async for batch in _streamed(self._channel_handle, sub):
            yield cast(DeltaBatch | OnSocket, batch)

    async def info(self) -> WorkerInfo:
        if self._info is None:
            self._handles()  # the plain handle shares the streaming one's router
            self._info = await self._handle.info.remote()
        return self._info

    async def replica_stats(self) -> ReplicaSnapshot:
        """Every worker replica's latest stats; {} before any replica reported (or when the
        index actor does not answer within `stats_timeout_s`)."""
        from ray.exceptions import RayError

        from cluster.transport import find_index_actor

        if self._index is None:
            # A blocking GCS lookup: off the event loop. Only workers create the actor.
            self._index = await asyncio.to_thread(find_index_actor, self._index_name)
            if self._index is None:
                return {}
        ref: ObjectRef[ReplicaSnapshot] = self._index.replica_stats.remote(
            self._stale_after_s, self._forget_after_s
        )
        try:
            return await asyncio.wait_for(ref, self._stats_timeout_s)
        except (asyncio.TimeoutError, RayError) as exc:
            log.warning("replica stats from %s failed: %s", self._index_name, exc)
            self._index = None
            return {}


async def _streamed(handle: DeploymentHandle[WorkerDeployment], *args: object) -> AsyncGenerator[object]:
    """The items of one streaming call; leaving early cancels it (the worker aborts what it
    runs for it)."""
    from ray.serve.handle import DeploymentResponseGenerator

    from cluster.ray_private import own_request_id

    with own_request_id():  # one HTTP request makes several worker calls at once
        gen = handle.remote(*args)
    assert isinstance(gen, DeploymentResponseGenerator), "the stream handle streams"
    try:
        async for item in gen:
            yield item
    finally:
        # Normal end: a no-op. Early exit (client gone, stop string): aborts on the worker.
        gen.cancel()


def _node_address() -> str:
    """Where this ingress's delta socket listens: its node's address in the Ray cluster (the
    one the worker replicas reach it at; 127.0.0.1 on a local cluster)."""
    import ray

    return str(ray.util.get_node_ip_address())


def replica_gone(e: BaseException) -> bool:
    """The replica died, became unreachable, or aborted the request while shutting down."""
    from ray.exceptions import RayActorError

    return isinstance(e, (RayActorError, WorkerUnavailableError))


def engine_died(e: BaseException) -> bool:
    """The engine serving the request died while running it (its replica's process with it, or
    not): the request may be why (`DeathRecord`)."""
    from ray.exceptions import RayActorError

    return isinstance(e, (RayActorError, EngineDiedError))


def _placed_on(request_id: str) -> str | None:
    """The replica this process's router last sent the request to (None: not known)."""
    placement = routing_record.placement_of(request_id)
    return placement.worker_id if placement is not None else None
