"""An engine's stats → the routing stats a worker reports (the one place that maps them).

Both the deployed worker (`deploy.replica.deployment.WorkerDeployment.record_routing_stats`) and the
routing simulator (`bench.routing.sim`) call `routing_stats`, so the benchmark measures the load
signal the deployed router sees. The keys and their meaning: `cluster.messages`.
"""

from __future__ import annotations

from cluster.messages import PoolHeadroom, make_routing_stats
from core.outputs import EngineStats, PoolStats


def routing_stats(
    stats: EngineStats, worker_id: str, timestamp_s: float
) -> dict[str, float | int | str]:
    """The routing-stats dict (`cluster.messages.make_routing_stats`) of one engine sample."""
    return make_routing_stats(
        worker_id=worker_id,
        timestamp_s=timestamp_s,
        queue_len=stats.waiting,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        running_decodes=stats.running_decodes,
        full=_headroom(stats.full),
        swa=_headroom(stats.swa),
    )


def _headroom(pool: PoolStats) -> PoolHeadroom:
    return PoolHeadroom(pool.free, pool.evictable, pool.total)
