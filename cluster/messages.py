"""Every type that crosses a process boundary (plain, picklable dataclasses; no torch).

Who sends what:

| message | from → to | carries |
|---|---|---|
| `EventBatch` | worker replica → index actor → routers | the cache events of one drain, numbered |
| `CacheSnapshot`, `WorkerMeta`, `WorkerResync` | worker replica → index actor | a resync after a gap or restart; the worker's geometry, pools and tier costs |
| `WorkerRemoved` | router / replica → index actor | a replica left |
| `StatsRefresh` | worker replica → index actor | a stats sample alone, on the event socket |
| `PushAck`, `Delta` | index actor → worker / router | push answer; a router's pull |
| routing stats (`routing_stats` of an engine sample, `make_routing_stats`, `WorkerLoad`) | worker replica → Serve → routers | load and both pools' headroom |
| `RoutedRequest` | ingress → router → worker replica | the prompt, its sampling params, replicas to avoid |
| `StreamStart`, `WorkerInfo` | worker replica → ingress | who serves, or why refused; model facts |

The cache events themselves (`CacheEvent`, `EventKind`, `PageState`, page hashes) are the
worker's vocabulary and live in `core.events`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from core.events import CacheEvent, PageState
from core.geometry import Geometry
from core.outputs import EngineStats, PoolStats
from core.reuse import TierCosts
from core.sampling_params import SamplingParams

# ---- cache events between worker, index actor and routers ----------------------------------


@dataclass(frozen=True)
class EventBatch:
    """Events of one drain, stamped with the worker's sequence number (1, 2, 3, …)."""

    worker_id: str
    incarnation: str
    seq: int
    events: tuple[CacheEvent, ...]


@dataclass(frozen=True)
class CacheSnapshot:
    """Every cached page of one worker at sequence number `seq` (for resync after a gap)."""

    worker_id: str
    incarnation: str
    seq: int
    pages: dict[int, PageState] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerMeta:
    """Sent once when a worker replica starts."""

    worker_id: str
    incarnation: str
    # Page size, window (None: no SWA layer, every prefix with full KV is valid) and SWA layers
    # (what the repair rule needs: core/reuse.py, docs/design.md §9.8).
    geometry: Geometry
    full_tokens: int
    swa_tokens: int
    hybrid: bool
    tombstone_repair: bool = False  # the worker repairs tombstoned prefixes
    # What loading a token's KV from the worker's host tier costs against computing it
    # (core/reuse.py `choose_reuse`); None: no host tier, so only device KV is reused.
    tier_costs: TierCosts | None = None
    host_full_tokens: int = 0  # the host tier's full KV capacity (pages there are indexed too)


@dataclass(frozen=True)
class WorkerResync:
    """A worker's metadata and its whole cache at `snapshot.seq`.

    `snapshot=None` means "known worker, state unknown": the entry is stale (matches count 0)
    until a later resync brings a snapshot. A fresh replica registers with an empty snapshot at
    seq 0, so its first batch (seq 1) applies directly.
    """

    meta: WorkerMeta
    snapshot: CacheSnapshot | None

    def __post_init__(self) -> None:
        snap, meta = self.snapshot, self.meta
        if snap is not None and (snap.worker_id, snap.incarnation) != (
            meta.worker_id,
            meta.incarnation,
        ):
            raise ValueError(
                f"snapshot of {snap.worker_id}/{snap.incarnation} sent with metadata of "
                f"{meta.worker_id}/{meta.incarnation}; take both from the same engine"
            )


@dataclass(frozen=True)
class WorkerRemoved:
    """The replica is gone. `incarnation=None` removes whatever incarnation is indexed."""

    worker_id: str
    incarnation: str | None = None


# Every change to a `ClusterIndex` is one update; the index actor logs the updates it accepted
# in order and routers replay them, so each router's index is a deterministic copy.
IndexUpdate = EventBatch | WorkerResync | WorkerRemoved


@dataclass(frozen=True)
class StatsRefresh:
    """A worker push that carries only a stats sample (no cache event since the last one): on
    the event socket in a batch's place (`cluster.event_socket`)."""

    worker_id: str
    incarnation: str


@dataclass(frozen=True)
class PushAck:
    """The index actor's answer to a worker push."""

    resync_needed: bool  # send WorkerResync(meta, snapshot) before the next batch


@dataclass(frozen=True)
class Delta:
    """What a router's pull returns.

    `reset=True`: drop the local index and rebuild from `updates` (a full resync per worker);
    happens on the first pull, after the actor restarted (new `epoch`) or when the router's
    cursor fell behind the actor's bounded log.
    """

    epoch: str
    since: int  # the cursor this delta continues from (ignored when reset)
    cursor: int  # pass back on the next pull
    reset: bool
    updates: tuple[IndexUpdate, ...]


# ---- routing stats: worker replica → Serve → routers ---------------------------------------
# A replica returns `make_routing_stats(...)` from its Serve `record_routing_stats()`; Serve
# polls it every `request_routing_stats_period_s` and hands the dict to every router as
# `RunningReplica.routing_stats`, where `WorkerLoad.from_routing_stats` reads it back. The keys
# are the whole contract; counts are tokens unless the name says otherwise:
#   worker_id            the id the replica stamps on its cache events (Serve replica unique id)
#   timestamp_s          time.time() of the sample (routers add their own later decisions)
#   queue_len            requests waiting for admission (not prefilled at all yet)
#   queued_prefill_tokens  prompt tokens still to compute: waiting requests (after their cache
#                        hit) plus the unfinished rest of chunked prefills
#   running_decodes      requests in the decode phase
#   {full,swa}_{free,evictable,total}_tokens  each pool's free slots, slots held only by the
#                        radix cache (reclaimable), allocatable slots; one pool: both prefixes

# A replica's flat stats: the routing stats below (the router's contract), plus, for `/metrics`,
# every engine number (deploy/metrics.py). Values are numbers except `worker_id`.
StatsDict = dict[str, float | int | str]

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
                f"routing stats lack {missing}; build them with cluster.messages.make_routing_stats"
            )
        n = {k: _non_negative_int(k, stats[k]) for k in _INT_KEYS}
        return cls(
            worker_id=str(stats[STAT_WORKER_ID]),
            timestamp_s=float(stats[STAT_TIMESTAMP_S]),
            queue_len=n[STAT_QUEUE_LEN],
            queued_prefill_tokens=n[STAT_QUEUED_PREFILL_TOKENS],
            running_decodes=n[STAT_RUNNING_DECODES],
            full=PoolHeadroom(
                n[STAT_FULL_FREE_TOKENS], n[STAT_FULL_EVICTABLE_TOKENS], n[STAT_FULL_TOTAL_TOKENS]
            ),
            swa=PoolHeadroom(
                n[STAT_SWA_FREE_TOKENS], n[STAT_SWA_EVICTABLE_TOKENS], n[STAT_SWA_TOTAL_TOKENS]
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
) -> StatsDict:
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


def routing_stats(stats: EngineStats, worker_id: str, timestamp_s: float) -> StatsDict:
    """The routing stats of one engine sample: the one place that maps an engine's stats to
    them. Both the deployed worker (`WorkerDeployment.record_routing_stats`) and the routing
    simulator (`bench.routing.sim`) call it, so the benchmark measures the load signal the
    deployed router sees."""
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


def _non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"routing stat {key!r} must be a number, got {value!r}")
    if value < 0:
        raise ValueError(f"routing stat {key!r} must be >= 0, got {value}")
    return int(value)


# ---- a request: ingress → router → worker replica → ingress --------------------------------


@dataclass(frozen=True)
class RoutedRequest:
    """The first positional argument of every worker handle call.

    The router reads `token_ids` and decides; Serve sends the request as it is to the replica it
    picks. The decision stays in the ingress's process (`router/routing_record.py`).
    """

    token_ids: list[int]  # the whole prompt (the router hashes token_ids[:-1], as the worker matches)
    request_id: str = ""
    max_new_tokens: int = 0  # for the capacity estimate (all choices); 0 when unknown
    params: SamplingParams | None = None  # opaque to the router; None: the engine's defaults
    # More choices of the same prompt, served by the same replica so they share its prefill;
    # the stream's deltas carry each choice's id (`choice_ids`).
    sibling_params: tuple[SamplingParams, ...] = ()
    # Replicas to rank last: a retry after a replica died or refused (deploy/replica/client.py).
    avoid: tuple[str, ...] = ()

    @property
    def choice_ids(self) -> list[str]:
        """The engine request id of each choice: `request_id`, then `request_id/1`, …."""
        return [self.request_id] + [f"{self.request_id}/{k}" for k in range(1, 1 + len(self.sibling_params))]


RefusalKind = Literal["invalid", "unavailable"]  # -> HTTP 400 / 503


@dataclass(frozen=True)
class StreamStart:
    """The first item of every worker `generate` stream: which replica took the request and
    whether it refused it, before the ingress commits to an HTTP status."""

    replica_id: str
    refusal: RefusalKind | None = None
    message: str | None = None  # why it was refused; says what to change
    # The delta channel (subscription) this attempt's deltas go to instead of this stream
    # (`deploy/replica/channel.py`); None: they follow on this stream.
    channel: str | None = None


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts about the served model, fetched once by the ingress."""

    replica_id: str
    max_model_len: int
    model_dir: str
    page_size: int


class WorkerUnavailableError(RuntimeError):
    """The worker cannot finish this request (shutting down, engine gone); the ingress answers 503."""


class EngineDiedError(WorkerUnavailableError):
    """The worker's engine died while running this request (it may be why): the ingress sends
    it again at most once (`deploy.replica.client.DeathRecord`), then answers 503."""
