"""What crosses processes: cache-event transport, the cluster cache index, Ray bootstrap.

Ray-free here; the Ray side is `cluster.transport` (index actor, publisher, subscriber) and
`cluster.ray_local` (loopback cluster), imported explicitly.
"""

from cluster.index import ApplyOutcome, ClusterIndex, IndexLimits
from cluster.messages import PoolHeadroom, WorkerLoad, make_routing_stats

__all__ = [
    "ApplyOutcome",
    "ClusterIndex",
    "IndexLimits",
    "PoolHeadroom",
    "WorkerLoad",
    "make_routing_stats",
]
