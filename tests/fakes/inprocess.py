"""An in-process `WorkerClient` over real `WorkerDeployment`s (no Ray): the ingress logic and the
worker deployment class meet exactly as through Serve, minus the transport, deltas included:
each attempt goes through `Channels`, so once a worker has answered a first request, its
deltas come on this ingress's delta channel to it (`WorkerDeployment.deltas`)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

from cluster.messages import RoutedRequest, StreamStart, WorkerInfo, WorkerUnavailableError
from cluster.replica_stats import ReplicaSnapshot
from core.outputs import StreamDelta
from deploy.replica.channel import DeltaBatch, OnSocket, Subscribe
from deploy.replica.channels import Channels
from deploy.replica.client import DeathRecord
from deploy.replica.deployment import WorkerDeployment


class InProcessWorkerClient:
    def __init__(self, workers: list[WorkerDeployment]) -> None:
        self.workers = workers
        self._next = itertools.cycle(range(len(workers)))
        self.channels = Channels(self._subscribe)

    async def stream(
        self, request: RoutedRequest, deaths: DeathRecord | None = None
    ) -> AsyncIterator[StreamStart | StreamDelta]:
        """Round robin over the workers, each request sent once (the service's restarts still
        apply; `ServeWorkerClient`'s resends and `deaths` are tested on their own)."""
        worker = self.workers[next(self._next)]
        gen = self.channels.attempt(request, lambda key: worker.generate(request, key))
        try:
            async for item in gen:
                yield item
        finally:
            await gen.aclose()

    async def _subscribe(self, sub: Subscribe) -> AsyncIterator[DeltaBatch | OnSocket]:
        """The channel call, "routed" to the replica it names (`router.pinned`)."""
        named = [w for w in self.workers if w.replica_id == sub.replica_id]
        if not named:
            raise WorkerUnavailableError(f"no worker {sub.replica_id}")
        gen = named[0].deltas(sub)
        try:
            async for batch in gen:
                yield batch
        finally:
            await gen.aclose()

    async def info(self) -> WorkerInfo:
        return self.workers[0].info()

    async def replica_stats(self) -> ReplicaSnapshot:
        return {w.replica_id: await w.record_routing_stats() for w in self.workers}
