"""What the transport carries besides the worker's `EventBatch` (plain, picklable dataclasses).

Every change to a `ClusterIndex` is one `IndexUpdate`; the index actor logs the updates it
accepted in order and routers replay them, so each router's index is a deterministic copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.protocol import CacheSnapshot, EventBatch, WorkerMeta


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
        snap = self.snapshot
        if snap is not None and (snap.worker_id, snap.incarnation) != (
            self.meta.worker_id,
            self.meta.incarnation,
        ):
            raise ValueError(
                f"snapshot of {snap.worker_id}/{snap.incarnation} sent with metadata of "
                f"{self.meta.worker_id}/{self.meta.incarnation}; take both from the same engine"
            )


@dataclass(frozen=True)
class WorkerRemoved:
    """The replica is gone. `incarnation=None` removes whatever incarnation is indexed."""

    worker_id: str
    incarnation: str | None = None


IndexUpdate = EventBatch | WorkerResync | WorkerRemoved


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
