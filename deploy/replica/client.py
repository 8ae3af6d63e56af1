"""How the ingress reaches the worker deployment: request streams, model info, per-replica stats.

`WorkerClient` is the seam: `ServeWorkerClient` talks to Ray Serve, tests plug in an in-process
client around `WorkerDeployment` and a fake engine.

Per-replica stats (`/metrics`, `/health`) need *every* replica, which a `DeploymentHandle` cannot
address (it routes each call to one replica of the router's choosing). So the ingress asks the
Serve controller for the running replicas of the worker deployment and calls each replica actor's
`record_routing_stats` — the same call the controller makes for routers — with a short timeout.
NOTE: this uses two Serve-internal entry points (`_all_running_replicas` on the controller and the
replica actor's `record_routing_stats`); Ray is pinned (2.60.0) and both are exercised by the
`ray` tests, so an upgrade that moves them fails loudly there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from cluster.messages import StreamStart, WorkerInfo
from worker.outputs import StreamDelta

ReplicaSnapshot = dict[str, dict[str, Any] | None]  # replica id -> flat stats, None: no answer


class WorkerClient(Protocol):
    def stream(self, request: Any) -> AsyncIterator[StreamStart | StreamDelta]: ...

    async def info(self) -> WorkerInfo: ...

    async def replica_stats(self) -> ReplicaSnapshot: ...


class ServeWorkerClient:
    def __init__(self, handle: Any, stats_timeout_s: float = 3.0) -> None:
        self._handle = handle
        self._stream_handle = handle.options(stream=True, method_name="generate")
        self._stats_timeout_s = stats_timeout_s
        self._info: WorkerInfo | None = None
        self._actors: dict[str, tuple[str, Any]] = {}  # replica id -> (actor name, actor handle)

    async def stream(self, request: Any) -> AsyncIterator[StreamStart | StreamDelta]:
        gen = self._stream_handle.remote(request)
        try:
            async for item in gen:
                yield item
        finally:
            # Normal end: a no-op. Early exit (client gone, stop string): aborts on the worker.
            gen.cancel()

    async def info(self) -> WorkerInfo:
        if self._info is None:
            self._info = await self._handle.info.remote()
        return self._info

    async def replica_stats(self) -> ReplicaSnapshot:
        running = await self._running_replicas()
        ids = list(running)
        results = await asyncio.gather(*(self._stats_of(running[r]) for r in ids))
        return dict(zip(ids, results))

    async def _running_replicas(self) -> dict[str, Any]:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        name, app = self._handle.deployment_name, self._handle.app_name
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        infos = await controller._all_running_replicas.remote()
        out: dict[str, Any] = {}
        for dep_id, replicas in infos.items():
            if dep_id.name != name or dep_id.app_name != app:
                continue
            for info in replicas:
                out[info.replica_id.unique_id] = self._actor(info.replica_id.unique_id, info.actor_name)
        self._actors = {k: v for k, v in self._actors.items() if k in out}
        return out

    def _actor(self, replica_id: str, actor_name: str) -> Any:
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        cached = self._actors.get(replica_id)
        if cached is None or cached[0] != actor_name:
            cached = (actor_name, ray.get_actor(actor_name, namespace=SERVE_NAMESPACE))
            self._actors[replica_id] = cached
        return cached[1]

    async def _stats_of(self, actor: Any) -> dict[str, Any] | None:
        t0 = time.monotonic()
        try:
            stats = await asyncio.wait_for(actor.record_routing_stats.remote(), self._stats_timeout_s)
        except Exception:  # noqa: BLE001 - a replica that does not answer is reported as down
            return None
        stats = dict(stats)
        stats["scrape_seconds"] = time.monotonic() - t0
        return stats
