"""Cache events out of the tree (docs/design.md §4.3): a buffer the engine drains.

Events name pages by chained page hash (`core.events.page_hashes`); each node keeps its
pages' hashes, so the tree emits an event per node state change:

| tree change                              | event              | page state after |
|------------------------------------------|--------------------|------------------|
| live node created                        | STORED             | LIVE             |
| node created without SWA (tombstone)     | STORED_FULL_ONLY   | TOMBSTONE        |
| node deleted (full eviction)             | REMOVED            | absent           |
| node tombstoned (SWA eviction / release) | SWA_REMOVED        | TOMBSTONE        |
| tombstone revived by an insert           | SWA_RESTORED       | LIVE             |
| cache emptied                            | CLEARED            | all absent       |

Splits emit nothing (the pages do not change). The engine stamps sequence numbers per drain.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Pages are named by *chained* hashes: h_i = H(h_{i-1}, tokens of page i), h_{-1} = ROOT_HASH,
# so one hash names a whole page-aligned prefix. The router computes the same chain.
ROOT_HASH = 0


def _page_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every *complete* page of `tokens` (a trailing partial page is ignored)."""
    out: list[int] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = _page_hash(parent, tokens[start : start + page_size])
        out.append(parent)
    return out


class EventKind(str, enum.Enum):
    STORED = "stored"  # full and SWA KV now present for these pages
    REMOVED = "removed"  # full eviction: the pages are gone
    SWA_REMOVED = "swa_removed"  # became tombstones: full KV kept, SWA KV freed
    SWA_RESTORED = "swa_restored"  # tombstones revived with fresh SWA KV
    STORED_FULL_ONLY = "stored_full_only"  # stored as tombstones (SWA already out of window)
    CLEARED = "cleared"  # the whole cache was emptied


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: EventKind
    page_hashes: tuple[int, ...] = ()


class PageState(str, enum.Enum):
    LIVE = "live"  # full + SWA KV present
    TOMBSTONE = "tombstone"  # full KV present, SWA KV freed


_STATE_AFTER: dict[EventKind, PageState | None] = {
    EventKind.STORED: PageState.LIVE,
    EventKind.STORED_FULL_ONLY: PageState.TOMBSTONE,
    EventKind.SWA_RESTORED: PageState.LIVE,
    EventKind.SWA_REMOVED: PageState.TOMBSTONE,
    EventKind.REMOVED: None,
}


class EventLog:
    """Buffered cache events; `enabled=False` drops them (benchmarks, caches nobody mirrors)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._buf: list[CacheEvent] = []

    def emit(self, kind: EventKind, hashes: Iterable[int] = ()) -> None:
        if self.enabled:
            self._buf.append(CacheEvent(kind, tuple(hashes)))

    def drain(self) -> list[CacheEvent]:
        out, self._buf = self._buf, []
        return out

    def __len__(self) -> int:
        return len(self._buf)


def replay(
    events: Iterable[CacheEvent], pages: dict[int, PageState] | None = None
) -> dict[int, PageState]:
    """Apply events to a page-hash → state dict (what a consumer's index does).

    Raises ValueError on an event that contradicts the state (e.g. SWA_REMOVED of an absent
    page): such a stream cannot come from one tree, so the consumer must resync.
    """
    pages = {} if pages is None else pages
    for ev in events:
        if ev.kind is EventKind.CLEARED:
            pages.clear()
            continue
        after = _STATE_AFTER[ev.kind]
        for h in ev.page_hashes:
            _check_transition(ev.kind, pages.get(h), h)
            if after is None:
                del pages[h]
            else:
                pages[h] = after
    return pages


def _check_transition(kind: EventKind, before: PageState | None, h: int) -> None:
    ok = {
        EventKind.STORED: before is None,
        EventKind.STORED_FULL_ONLY: before is None,
        EventKind.REMOVED: before is not None,
        EventKind.SWA_REMOVED: before is PageState.LIVE,
        EventKind.SWA_RESTORED: before is PageState.TOMBSTONE,
    }[kind]
    if not ok:
        raise ValueError(
            f"event {kind.value} for page {h:#x} in state {before}: stream out of sync"
        )
