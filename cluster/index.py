"""The cluster cache index: per worker, page hash → page state (LIVE, TOMBSTONE and the host
tier's SWA_HOST, HOST, HOST_TOMBSTONE: core/events.py), rebuilt from cache events.

Per-worker state machine (docs/design.md §4.3):

| input | condition | effect | outcome |
|---|---|---|---|
| `WorkerResync(meta, snap)` | snap given | pages := snap.pages, seq := snap.seq, fresh | `RESYNCED` |
| `WorkerResync(meta, None)` | — | pages cleared, stale | `STALE` |
| `EventBatch` | worker unknown | — | `UNKNOWN_WORKER` |
| `EventBatch` | other incarnation | entry dropped (a restarted replica starts clean) | `NEW_INCARNATION` |
| `EventBatch` | entry stale | ignored | `STALE` |
| `EventBatch` | seq ≤ entry.seq | ignored | `DUPLICATE` |
| `EventBatch` | seq = entry.seq + 1 | events applied | `APPLIED` |
| `EventBatch` | seq = entry.seq + 1, an event contradicts a page's state | pages cleared, stale | `OUT_OF_SYNC` |
| `EventBatch` | seq > entry.seq + 1 | pages cleared, stale | `GAP` |
| `WorkerRemoved` | — | entry dropped | `REMOVED` |

A stale or missing worker matches 0 pages, never a stale positive.

Events move a present page by `core.events.state_after` (the worker's own transition table); a
transition no tree makes (SWA_LOADED of a LIVE page, STORED of a present one) means the stream
and the index disagree, so the worker resyncs (`OUT_OF_SYNC`). A snapshot's seq covers every
event it reflects (the replica drains and snapshots at once), so batches at or below it are
dropped as duplicates and never replayed on top of it.

Memory is bounded: a worker keeps at most `min(limits.max_pages_per_worker, its full pool in
pages)` pages and the index at most `limits.max_workers` workers. Pages past the bound are evicted
oldest first. NOTE: evicting an index entry only ever makes a prediction smaller, never larger:
a valid match needs *every* page of the prefix present, and a removed page (or a page read as
absent) can only end that prefix earlier; later events about an evicted page (anything but
STORED / STORED_FULL_ONLY, which re-add it in a state known exactly) are ignored rather than
re-adding it, so the entry stays "absent" = conservative. A page the index holds therefore
always has the state the worker's tree gives it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from cluster.messages import (
    CacheSnapshot,
    EventBatch,
    IndexUpdate,
    WorkerMeta,
    WorkerRemoved,
    WorkerResync,
)
from cluster.page_map import PageMap
from core.events import CacheEvent, EventKind, PageState, state_after


@dataclass(frozen=True)
class IndexLimits:
    max_pages_per_worker: int = 1 << 20  # also capped by the worker's full pool (in pages)
    max_workers: int = 1024

    def __post_init__(self) -> None:
        if self.max_pages_per_worker < 1 or self.max_workers < 1:
            raise ValueError(f"IndexLimits must be positive, got {self}")


class ApplyOutcome(str, enum.Enum):
    APPLIED = "applied"
    RESYNCED = "resynced"
    DUPLICATE = "duplicate"
    GAP = "gap"
    STALE = "stale"
    UNKNOWN_WORKER = "unknown_worker"
    NEW_INCARNATION = "new_incarnation"
    OUT_OF_SYNC = "out_of_sync"
    REMOVED = "removed"

    @property
    def resync_needed(self) -> bool:
        """The worker must send a `WorkerResync` before its batches count again."""
        return self in _NEEDS_RESYNC

    @property
    def changed(self) -> bool:
        """The index changed (the actor logs exactly these updates for routers to replay)."""
        return self in _CHANGED


_NEEDS_RESYNC = frozenset(
    {
        ApplyOutcome.GAP,
        ApplyOutcome.STALE,
        ApplyOutcome.UNKNOWN_WORKER,
        ApplyOutcome.NEW_INCARNATION,
        ApplyOutcome.OUT_OF_SYNC,
    }
)
_CHANGED = frozenset(
    {
        ApplyOutcome.APPLIED,
        ApplyOutcome.RESYNCED,
        ApplyOutcome.GAP,
        ApplyOutcome.NEW_INCARNATION,
        ApplyOutcome.OUT_OF_SYNC,
        ApplyOutcome.REMOVED,
    }
)


@dataclass(slots=True)
class WorkerEntry:
    meta: WorkerMeta
    bit: int  # this worker's bit in the PageMap bitsets
    max_pages: int
    seq: int = 0
    stale: bool = False
    pages: OrderedDict[int, PageState] = field(default_factory=OrderedDict)  # oldest first
    evicted_pages: int = 0  # dropped by the memory bound (observability)


class ClusterIndex:
    """All workers' pages, plus the inverted `PageMap` the router matches against."""

    def __init__(self, limits: IndexLimits | None = None) -> None:
        self.limits = limits or IndexLimits()
        self.page_map = PageMap()
        self._workers: dict[str, WorkerEntry] = {}
        self._free_bits: list[int] = []
        self._next_slot = 0

    # ---- queries -------------------------------------------------------------------------
    def worker(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def workers(self) -> Iterator[WorkerEntry]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def snapshot(self, worker_id: str) -> CacheSnapshot | None:
        """The indexed cache of one worker; None when unknown or stale."""
        entry = self._workers.get(worker_id)
        if entry is None or entry.stale:
            return None
        pages = dict(entry.pages)
        return CacheSnapshot(entry.meta.worker_id, entry.meta.incarnation, entry.seq, pages)

    def resyncs(self) -> list[WorkerResync]:
        """The whole index as one resync per worker (how a late router bootstraps)."""
        return [
            WorkerResync(e.meta, self.snapshot(e.meta.worker_id)) for e in self._workers.values()
        ]

    # ---- updates -------------------------------------------------------------------------
    def apply_update(self, update: IndexUpdate) -> ApplyOutcome:
        if isinstance(update, EventBatch):
            return self.apply(update)
        if isinstance(update, WorkerResync):
            return self.resync(update)
        if isinstance(update, WorkerRemoved):
            return self.remove(update.worker_id, update.incarnation)
        raise TypeError(f"not an index update: {type(update).__name__}")

    def resync(self, update: WorkerResync) -> ApplyOutcome:
        """Replace a worker's entry with its metadata and snapshot (or mark it stale)."""
        meta = update.meta
        entry = self._workers.get(meta.worker_id)
        if entry is not None and entry.meta.incarnation != meta.incarnation:
            self._drop(entry)
            entry = None
        if entry is None:
            entry = self._add(meta)
        entry.meta = meta
        self._clear_pages(entry)
        if update.snapshot is None:
            entry.stale = True
            return ApplyOutcome.STALE
        entry.stale, entry.seq = False, update.snapshot.seq
        for page_hash, state in update.snapshot.pages.items():
            self._put(entry, page_hash, state)
        return ApplyOutcome.RESYNCED

    def apply(self, batch: EventBatch) -> ApplyOutcome:
        """Apply one batch of a worker's events, detecting gaps and restarts."""
        entry = self._workers.get(batch.worker_id)
        if entry is None:
            return ApplyOutcome.UNKNOWN_WORKER
        if entry.meta.incarnation != batch.incarnation:
            self._drop(entry)
            return ApplyOutcome.NEW_INCARNATION
        if entry.stale:
            return ApplyOutcome.STALE
        if batch.seq <= entry.seq:
            return ApplyOutcome.DUPLICATE
        if batch.seq > entry.seq + 1:
            self._clear_pages(entry)
            entry.stale = True
            return ApplyOutcome.GAP
        try:
            for event in batch.events:
                self._apply_event(entry, event)
        except ValueError:  # a transition no tree makes: the stream and the index disagree
            self._clear_pages(entry)
            entry.stale = True
            return ApplyOutcome.OUT_OF_SYNC
        entry.seq = batch.seq
        return ApplyOutcome.APPLIED

    def clear(self) -> None:
        """Forget every worker (a router rebuilding from a reset delta)."""
        for entry in list(self._workers.values()):
            self._drop(entry)

    def remove(self, worker_id: str, incarnation: str | None = None) -> ApplyOutcome:
        entry = self._workers.get(worker_id)
        if entry is None or (incarnation is not None and entry.meta.incarnation != incarnation):
            return ApplyOutcome.DUPLICATE
        self._drop(entry)
        return ApplyOutcome.REMOVED

    # ---- page mechanics ------------------------------------------------------------------
    def _apply_event(self, entry: WorkerEntry, event: CacheEvent) -> None:
        """Move each page of the event by `core.events.state_after` (which raises ValueError on
        a transition no tree makes)."""
        kind, pages, bit = event.kind, entry.pages, entry.bit
        if kind is EventKind.CLEARED:
            self._clear_pages(entry)
            return
        adds = kind is EventKind.STORED or kind is EventKind.STORED_FULL_ONLY
        # Deepest page first, so a stored chain's root page ends up most recent: the memory
        # bound then evicts leaf-side pages first, which costs the shortest matches.
        for page_hash in reversed(event.page_hashes):
            before = pages.get(page_hash)
            if before is None and not adds:
                continue  # e.g. evicted from the index: stays absent
            after = state_after(kind, before, page_hash)
            if after is None:
                del pages[page_hash]
                self.page_map.drop(page_hash, bit)
            elif before is None:
                self._put(entry, page_hash, after)
            else:
                pages[page_hash] = after
                self.page_map.set(page_hash, bit, after)

    def _put(self, entry: WorkerEntry, page_hash: int, state: PageState) -> None:
        pages = entry.pages
        pages[page_hash] = state
        pages.move_to_end(page_hash)
        self.page_map.set(page_hash, entry.bit, state)
        while len(pages) > entry.max_pages:
            old_hash, _ = pages.popitem(last=False)
            self.page_map.drop(old_hash, entry.bit)
            entry.evicted_pages += 1

    def _clear_pages(self, entry: WorkerEntry) -> None:
        for page_hash in entry.pages:
            self.page_map.drop(page_hash, entry.bit)
        entry.pages.clear()

    # ---- worker slots --------------------------------------------------------------------
    def _add(self, meta: WorkerMeta) -> WorkerEntry:
        if len(self._workers) >= self.limits.max_workers:
            # The oldest-registered worker goes: dropping an entry only lowers predictions.
            self._drop(next(iter(self._workers.values())))
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_slot = 1 << self._next_slot, self._next_slot + 1
        cap = self.limits.max_pages_per_worker
        if meta.full_tokens > 0:  # a worker never holds more pages (device and host tier)
            held = meta.full_tokens + meta.host_full_tokens
            cap = min(cap, max(1, held // meta.geometry.page_size))
        entry = WorkerEntry(meta, bit, cap)
        self._workers[meta.worker_id] = entry
        return entry

    def _drop(self, entry: WorkerEntry) -> None:
        self._clear_pages(entry)
        del self._workers[entry.meta.worker_id]
        self._free_bits.append(entry.bit)
