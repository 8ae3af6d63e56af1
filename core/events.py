"""Cache events out of the tree (docs/design.md §4.3): a buffer the engine drains.

Events name pages by chained page hash (`core.events.page_hashes`); each node keeps its
pages' hashes, so the tree emits an event per node state change. A page's state says where each
of its components lives: its FULL KV on the device or on the host tier, its SWA KV on the
device, on the host tier, or nowhere (a tombstone):

| state            | full KV | SWA KV |
|------------------|---------|--------|
| LIVE             | device  | device |
| TOMBSTONE        | device  | freed  |
| SWA_HOST         | device  | host   |
| HOST             | host    | host   |
| HOST_TOMBSTONE   | host    | freed  |

| tree change                                   | event             | state before → after             |
|-----------------------------------------------|-------------------|----------------------------------|
| live node created                             | STORED            | absent → LIVE                    |
| node created without SWA (tombstone)          | STORED_FULL_ONLY  | absent → TOMBSTONE               |
| node deleted (its full KV dropped, any tier)  | REMOVED           | any → absent                     |
| SWA KV freed (device eviction without a host  | SWA_REMOVED       | LIVE, SWA_HOST → TOMBSTONE;      |
| tier, or dropped from the host tier)          |                   | HOST → HOST_TOMBSTONE            |
| tombstone revived (insert, repair)            | SWA_RESTORED      | TOMBSTONE → LIVE                 |
| SWA KV moved to the host tier                 | SWA_OFFLOADED     | LIVE → SWA_HOST                  |
| SWA KV loaded back                            | SWA_LOADED        | SWA_HOST → LIVE                  |
| full KV moved to the host tier (device SWA    | OFFLOADED         | LIVE, SWA_HOST → HOST;           |
| moves with it)                                |                   | TOMBSTONE → HOST_TOMBSTONE       |
| full KV loaded back (SWA stays where it is)   | LOADED            | HOST → SWA_HOST;                 |
|                                               |                   | HOST_TOMBSTONE → TOMBSTONE       |
| cache emptied                                 | CLEARED           | all absent                       |

Splits emit nothing (the pages do not change). The engine stamps sequence numbers per drain.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Pages are named by *chained* hashes: h_i = H(h_{i-1}, tokens of page i), h_{-1} = the root
# hash, so one hash names a whole page-aligned prefix. The router computes the same chain. The
# root hash is ROOT_HASH, or a request's cache salt's (`salted_root`, docs/design.md §9.10).
ROOT_HASH = 0
_MASK_63 = 0x7FFF_FFFF_FFFF_FFFF
_SALT_PERSON = b"swaserve-salt"  # blake2b's personalisation: no salt hashes like a page


def salted_root(salt: str | None) -> int:
    """The root hash of a request's chain: ROOT_HASH without a cache salt, else a hash of the
    salt. Requests with different salts then share no page hash (and no tree root), so neither
    the worker's cache nor the router's index can match one salt's prefix for another."""
    if salt is None:
        return ROOT_HASH
    h = hashlib.blake2b(salt.encode(errors="surrogatepass"), digest_size=8, person=_SALT_PERSON)
    return int.from_bytes(h.digest(), "little") & _MASK_63


def _page_hash(parent: int, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little") & _MASK_63


def page_hashes(tokens: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every *complete* page of `tokens` (a trailing partial page is ignored)."""
    out: list[int] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = _page_hash(parent, tokens[start : start + page_size])
        out.append(parent)
    return out


class EventKind(str, enum.Enum):
    STORED = "stored"  # full and SWA KV now present (on the device) for these pages
    REMOVED = "removed"  # the pages are gone (full KV dropped from whichever tier held it)
    SWA_REMOVED = "swa_removed"  # SWA KV freed (from either tier): full KV kept
    SWA_RESTORED = "swa_restored"  # tombstones revived with fresh SWA KV
    STORED_FULL_ONLY = "stored_full_only"  # stored as tombstones (SWA already out of window)
    SWA_OFFLOADED = "swa_offloaded"  # SWA KV moved from the device to the host tier
    SWA_LOADED = "swa_loaded"  # SWA KV moved from the host tier back to the device
    OFFLOADED = "offloaded"  # full KV (and device SWA KV) moved to the host tier
    LOADED = "loaded"  # full KV moved back to the device (SWA KV stays where it is)
    CLEARED = "cleared"  # the whole cache was emptied


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: EventKind
    page_hashes: tuple[int, ...] = ()


class PageState(str, enum.Enum):
    LIVE = "live"  # full + SWA KV on the device
    TOMBSTONE = "tombstone"  # full KV on the device, SWA KV freed
    SWA_HOST = "swa_host"  # full KV on the device, SWA KV on the host tier
    HOST = "host"  # full + SWA KV on the host tier
    HOST_TOMBSTONE = "host_tombstone"  # full KV on the host tier, SWA KV freed

    @property
    def has_swa(self) -> bool:
        """SWA KV exists on some tier: the window rule counts the page as live."""
        return self not in (PageState.TOMBSTONE, PageState.HOST_TOMBSTONE)

    @property
    def full_on_host(self) -> bool:
        return self in (PageState.HOST, PageState.HOST_TOMBSTONE)

    @property
    def swa_on_host(self) -> bool:
        return self in (PageState.SWA_HOST, PageState.HOST)


_L, _T, _SH, _H, _HT = (PageState.LIVE, PageState.TOMBSTONE, PageState.SWA_HOST, PageState.HOST,
                        PageState.HOST_TOMBSTONE)  # fmt: skip
# (event, state before) -> state after; None: the page is gone. A pair missing here is an event
# that contradicts the state: such a stream cannot come from one tree.
_AFTER: dict[tuple[EventKind, PageState | None], PageState | None] = {
    (EventKind.STORED, None): _L,
    (EventKind.STORED_FULL_ONLY, None): _T,
    **{(EventKind.REMOVED, s): None for s in PageState},
    (EventKind.SWA_REMOVED, _L): _T,
    (EventKind.SWA_REMOVED, _SH): _T,
    (EventKind.SWA_REMOVED, _H): _HT,
    (EventKind.SWA_RESTORED, _T): _L,
    (EventKind.SWA_OFFLOADED, _L): _SH,
    (EventKind.SWA_LOADED, _SH): _L,
    (EventKind.OFFLOADED, _L): _H,
    (EventKind.OFFLOADED, _SH): _H,
    (EventKind.OFFLOADED, _T): _HT,
    (EventKind.LOADED, _H): _SH,
    (EventKind.LOADED, _HT): _T,
}


def state_after(kind: EventKind, before: PageState | None, page_hash: int) -> PageState | None:
    """The page's state after `kind` (None: gone). Raises ValueError on a transition no tree
    makes (the consumer must resync)."""
    key = (kind, before)
    if key not in _AFTER:
        raise ValueError(
            f"event {kind.value} for page {page_hash:#x} in state {before}: stream out of sync"
        )
    return _AFTER[key]


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
        for h in ev.page_hashes:
            after = state_after(ev.kind, pages.get(h), h)
            if after is None:
                del pages[h]
            else:
                pages[h] = after
    return pages
