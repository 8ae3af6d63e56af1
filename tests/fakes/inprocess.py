"""An in-process `WorkerClient` over real `WorkerDeployment`s (no Ray): the ingress logic and the
worker deployment class meet exactly as through Serve, minus the transport."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

from cluster.messages import RoutedRequest, StreamStart, WorkerInfo
from cluster.replica_stats import ReplicaSnapshot
from core.outputs import StreamDelta
from deploy.replica.client import DeathRecord
from deploy.replica.deployment import WorkerDeployment


class InProcessWorkerClient:
    def __init__(self, workers: list[WorkerDeployment]) -> None:
        self.workers = workers
        self._next = itertools.cycle(range(len(workers)))

    async def stream(
        self, request: RoutedRequest, deaths: DeathRecord | None = None
    ) -> AsyncIterator[StreamStart | StreamDelta]:
        """Round robin over the workers, each request sent once (the service's restarts still
        apply; `ServeWorkerClient`'s resends and `deaths` are tested on their own)."""
        worker = self.workers[next(self._next)]
        gen = worker.generate(request)
        try:
            async for item in gen:
                yield item
        finally:
            await gen.aclose()

    async def info(self) -> WorkerInfo:
        return self.workers[0].info()

    async def replica_stats(self) -> ReplicaSnapshot:
        return {w.replica_id: await w.record_routing_stats() for w in self.workers}
