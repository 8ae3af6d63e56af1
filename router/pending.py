"""Pages a placed request will leave on its worker, credited before their cache events arrive.

The worker inserts every prefill chunk of a prompt into its tree, the last one included, LIVE
(docs/design.md §10.1), so the moment the router places a request it knows which pages that
worker will hold. Until the index shows them, a decision would credit nothing there: a client's
next turn sent the instant its last one ended, a concurrent sibling, an agent's branch. So each
placement is recorded here, for its worker, as *pending* pages, and every decision credits them
at once (Dynamo's "active blocks" do the same for its KV router).

    prompt pages:  0 … v−1            v … n−1
                   as the index says  pending LIVE: the worker computes and inserts them
    v = the worker's valid match at placement (pages it reuses keep their state, tombstones too)

A placement that loads from the worker's host tier (docs/design.md §9.9) changes the pages it
reuses too: their full KV comes back to the device (pending *loaded*: HOST → SWA_HOST,
HOST_TOMBSTONE → TOMBSTONE), and the window before v gets its SWA KV back (pending LIVE from
v − ceil_P(W) on). `router.core.device_after` says which.

A record ends when
- its request completes: the worker published the request's cache events before its last delta,
  and the router pulls once before the next decision (docs/design.md §13.4), so from then on the
  index is the truth, corrections included (pages tombstoned or evicted meanwhile);
- the index holds all its pages on that worker (confirmed; rechecked when that worker's
  sequence number moves, so long generations stop relying on the prediction early);
- it is older than `ttl_s` (no event confirmed it and no completion came);
- its worker leaves the index or comes back as another incarnation.

The overlay works on `PageMap` bitsets: hash → bits of the workers where it is pending (LIVE,
loaded), merged into the index's `(present, tomb, host_full, host_swa)` entry by
`OverlaidPages.lookup` (a pending LIVE page is present and LIVE there, a pending loaded one has
its full KV on the device), so `router.match.match_chain` walks both in one pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cluster.index import ClusterIndex, WorkerEntry
from cluster.page_map import Entry, PageMap
from core.events import PageState

DEFAULT_TTL_S = 10.0


@dataclass(slots=True)
class _Record:
    worker_id: str
    hashes: tuple[int, ...]  # the pages that will be LIVE on the worker
    at: float
    loaded: tuple[int, ...] = ()  # the pages whose full KV comes back from the host tier
    missing: int = 0  # the page `_confirmed` last found absent: tested first next time


@dataclass(slots=True)
class _Worker:
    """One worker's records; all were made against the same index entry (incarnation, bit)."""

    incarnation: str
    bit: int
    checked_seq: int  # the entry's seq when its records were last checked against it
    keys: dict[str, None] = field(default_factory=dict)


class _PendingBits:
    """page hash → bits of the workers where it is pending, reference-counted per record."""

    __slots__ = ("bits", "_refs")

    def __init__(self) -> None:
        self.bits: dict[int, int] = {}
        self._refs: dict[tuple[int, int], int] = {}  # (bit, page hash) → records holding it

    def add(self, bit: int, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            ref = (bit, h)
            self._refs[ref] = self._refs.get(ref, 0) + 1
            self.bits[h] = self.bits.get(h, 0) | bit

    def remove(self, bit: int, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            ref = (bit, h)
            left = self._refs[ref] - 1
            if left:
                self._refs[ref] = left
                continue
            del self._refs[ref]
            bits = self.bits[h] & ~bit
            if bits:
                self.bits[h] = bits
            else:
                del self.bits[h]


class PendingPages:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_records: int = 1 << 14) -> None:
        if ttl_s <= 0 or max_records < 1:
            raise ValueError(f"ttl_s and max_records must be positive, got {ttl_s}, {max_records}")
        self.ttl_s = ttl_s
        self._max = max_records
        self._records: OrderedDict[str, _Record] = (
            OrderedDict()
        )  # request key → record, oldest first
        self._workers: dict[str, _Worker] = {}
        self._live = _PendingBits()
        self._loaded = _PendingBits()
        self.confirmed = 0  # records ended by the index holding their pages (observability)

    def __len__(self) -> int:
        return len(self._records)

    def record(
        self,
        key: str,
        entry: WorkerEntry,
        hashes: Sequence[int],
        at: float,
        loaded: Sequence[int] = (),
    ) -> None:
        """Request `key` placed on `entry`'s worker will leave `hashes` LIVE there and the full
        KV of `loaded` on its device (a retry of the same key replaces its record)."""
        self.complete(key)
        if not hashes and not loaded:
            return
        worker_id = entry.meta.worker_id
        w = self._workers.get(worker_id)
        if w is not None and (w.incarnation, w.bit) != (entry.meta.incarnation, entry.bit):
            self.forget_worker(worker_id)
            w = None
        if w is None:
            w = self._workers[worker_id] = _Worker(entry.meta.incarnation, entry.bit, entry.seq)
        rec = _Record(worker_id, tuple(hashes), at, tuple(loaded))
        self._records[key] = rec
        w.keys[key] = None
        self._live.add(w.bit, rec.hashes)
        self._loaded.add(w.bit, rec.loaded)
        while len(self._records) > self._max:
            self._drop(next(iter(self._records)))

    def complete(self, key: str) -> None:
        """The request ended (the index is current for it once the next pull lands)."""
        if key in self._records:
            self._drop(key)

    def worker_of(self, key: str) -> str | None:
        rec = self._records.get(key)
        return rec.worker_id if rec is not None else None

    def forget_worker(self, worker_id: str) -> None:
        w = self._workers.get(worker_id)
        for key in list(w.keys) if w is not None else ():
            self._drop(key)

    def settle(self, index: ClusterIndex, now: float) -> None:
        """Before a decision: expire old records, drop those whose worker left or changed, and
        end those the index now confirms."""
        while self._records:
            key, rec = next(iter(self._records.items()))
            if now - rec.at <= self.ttl_s:
                break
            self._drop(key)
        for worker_id, w in list(self._workers.items()):
            entry = index.worker(worker_id)
            if (
                entry is None
                or entry.stale
                or (w.incarnation, w.bit)
                != (
                    entry.meta.incarnation,
                    entry.bit,
                )
            ):
                self.forget_worker(worker_id)
            elif entry.seq != w.checked_seq:
                w.checked_seq = entry.seq
                self._confirm(w, entry)

    def overlay(self, page_map: PageMap) -> PageMap | OverlaidPages:
        """What the matcher walks: the index's page map with the pending pages merged in."""
        live, loaded = self._live.bits, self._loaded.bits
        return OverlaidPages(page_map, live, loaded) if live or loaded else page_map

    def _confirm(self, w: _Worker, entry: WorkerEntry) -> None:
        pages = entry.pages
        for key in [k for k in w.keys if _confirmed(self._records[k], pages)]:
            self.confirmed += 1
            self._drop(key)

    def _drop(self, key: str) -> None:
        rec = self._records.pop(key)
        w = self._workers[rec.worker_id]
        del w.keys[key]
        if not w.keys:
            del self._workers[rec.worker_id]
        self._live.remove(w.bit, rec.hashes)
        self._loaded.remove(w.bit, rec.loaded)


def _confirmed(rec: _Record, pages: Mapping[int, PageState]) -> bool:
    """The index holds the record's LIVE pages, and none of its loaded pages is on the host.

    NOTE: a worker mid-prefill holds a record's pages up to some depth; the page found absent
    last time is tested first, so an unconfirmed record costs one lookup per index change
    instead of a scan of its whole prefix (same answer: one absent page decides it)."""
    hashes = rec.hashes
    if hashes and hashes[rec.missing] not in pages:
        return False
    for i, h in enumerate(hashes):
        if h not in pages:
            rec.missing = i
            return False
    return not any((s := pages.get(h)) is not None and s.full_on_host for h in rec.loaded)


class OverlaidPages:
    """A `PageMap` read through the pending pages: present where either says so; a pending
    LIVE page has no tomb or host bit, a pending loaded one no host_full bit (the matcher only
    reads `lookup`)."""

    __slots__ = ("lookup",)

    def __init__(self, base: PageMap, live: dict[int, int], loaded: dict[int, int]) -> None:
        self.lookup: Callable[[int], Entry | None] = _merged(base.lookup, live.get, loaded.get)


def _merged(
    base: Callable[[int], Entry | None],
    live: Callable[[int], int | None],
    loaded: Callable[[int], int | None],
) -> Callable[[int], Entry | None]:
    def lookup(page_hash: int) -> Entry | None:
        bits = live(page_hash) or 0
        full = loaded(page_hash) or 0
        entry = base(page_hash)
        if not bits and not full:
            return entry
        if entry is None:
            return (bits, 0, 0, 0) if bits else None
        keep = ~bits
        return (entry[0] | bits, entry[1] & keep, entry[2] & ~(bits | full), entry[3] & keep)

    return lookup
