"""Load and capacity signals a worker replica reports to the routers.

The worker deployment returns `make_routing_stats(...)` from its Serve `record_routing_stats()`
method; Serve polls it every `request_routing_stats_period_s` and hands the dict to every router
as `RunningReplica.routing_stats`, where `WorkerLoad.from_routing_stats` reads it back. The keys
below are the whole contract; all counts are tokens unless the name says otherwise.

| key | meaning |
|---|---|
| `worker_id` | the id the replica stamps on its cache events (its Serve replica unique id) |
| `timestamp_s` | `time.time()` when the sample was taken (routers add their own later decisions) |
| `queue_len` | requests waiting for admission (not yet prefilled at all) |
| `queued_prefill_tokens` | prompt tokens still to compute: waiting requests (after their cache hit) plus the unfinished rest of chunked prefills |
| `running_decodes` | requests in the decode phase |
| `full_free_tokens`, `swa_free_tokens` | free slots of each pool |
| `full_evictable_tokens`, `swa_evictable_tokens` | slots held only by the radix cache (reclaimable) |
| `full_total_tokens`, `swa_total_tokens` | allocatable slots of each pool |

A non-hybrid worker reports its single pool under both prefixes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STAT_WORKER_ID = "worker_id"
STAT_TIMESTAMP_S = "timestamp_s"
STAT_QUEUE_LEN = "queue_len"
STAT_QUEUED_PREFILL_TOKENS = "queued_prefill_tokens"
STAT_RUNNING_DECODES = "running_decodes"
STAT_FULL_FREE_TOKENS = "full_free_tokens"
STAT_FULL_EVICTABLE_TOKENS = "full_evictable_tokens"
STAT_FULL_TOTAL_TOKENS = "full_total_tokens"
STAT_SWA_FREE_TOKENS = "swa_free_tokens"
STAT_SWA_EVICTABLE_TOKENS = "swa_evictable_tokens"
STAT_SWA_TOTAL_TOKENS = "swa_total_tokens"

_INT_KEYS = (
    STAT_QUEUE_LEN,
    STAT_QUEUED_PREFILL_TOKENS,
    STAT_RUNNING_DECODES,
    STAT_FULL_FREE_TOKENS,
    STAT_FULL_EVICTABLE_TOKENS,
    STAT_FULL_TOTAL_TOKENS,
    STAT_SWA_FREE_TOKENS,
    STAT_SWA_EVICTABLE_TOKENS,
    STAT_SWA_TOTAL_TOKENS,
)


@dataclass(frozen=True, slots=True)
class PoolHeadroom:
    """Capacity of one pool as the worker last reported it (tokens)."""

    free: int
    evictable: int
    total: int

    @property
    def allocatable(self) -> int:
        """Slots a new request can get now, evicting cached prefixes if needed."""
        return self.free + self.evictable


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One `record_routing_stats` sample, parsed."""

    worker_id: str
    timestamp_s: float
    queue_len: int
    queued_prefill_tokens: int
    running_decodes: int
    full: PoolHeadroom
    swa: PoolHeadroom

    @classmethod
    def from_routing_stats(cls, stats: Mapping[str, Any] | None) -> WorkerLoad | None:
        """Parse a routing-stats dict; None when the replica has not reported yet.

        Raises:
            ValueError: a key is missing or not a non-negative number (the message names it).
        """
        if not stats:
            return None
        missing = [k for k in (STAT_WORKER_ID, STAT_TIMESTAMP_S, *_INT_KEYS) if k not in stats]
        if missing:
            raise ValueError(
                f"routing stats lack {missing}; build them with cluster.load.make_routing_stats"
            )
        ints = {k: _non_negative_int(k, stats[k]) for k in _INT_KEYS}
        return cls(
            worker_id=str(stats[STAT_WORKER_ID]),
            timestamp_s=float(stats[STAT_TIMESTAMP_S]),
            queue_len=ints[STAT_QUEUE_LEN],
            queued_prefill_tokens=ints[STAT_QUEUED_PREFILL_TOKENS],
            running_decodes=ints[STAT_RUNNING_DECODES],
            full=PoolHeadroom(
                ints[STAT_FULL_FREE_TOKENS],
                ints[STAT_FULL_EVICTABLE_TOKENS],
                ints[STAT_FULL_TOTAL_TOKENS],
            ),
            swa=PoolHeadroom(
                ints[STAT_SWA_FREE_TOKENS],
                ints[STAT_SWA_EVICTABLE_TOKENS],
                ints[STAT_SWA_TOTAL_TOKENS],
            ),
        )


def make_routing_stats(
    *,
    worker_id: str,
    timestamp_s: float,
    queue_len: int,
    queued_prefill_tokens: int,
    running_decodes: int,
    full: PoolHeadroom,
    swa: PoolHeadroom,
) -> dict[str, float | int | str]:
    """The dict a worker replica returns from `record_routing_stats()`."""
    return {
        STAT_WORKER_ID: worker_id,
        STAT_TIMESTAMP_S: timestamp_s,
        STAT_QUEUE_LEN: queue_len,
        STAT_QUEUED_PREFILL_TOKENS: queued_prefill_tokens,
        STAT_RUNNING_DECODES: running_decodes,
        STAT_FULL_FREE_TOKENS: full.free,
        STAT_FULL_EVICTABLE_TOKENS: full.evictable,
        STAT_FULL_TOTAL_TOKENS: full.total,
        STAT_SWA_FREE_TOKENS: swa.free,
        STAT_SWA_EVICTABLE_TOKENS: swa.evictable,
        STAT_SWA_TOTAL_TOKENS: swa.total,
    }


def _non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"routing stat {key!r} must be a number, got {value!r}")
    if value < 0:
        raise ValueError(f"routing stat {key!r} must be >= 0, got {value}")
    return int(value)
