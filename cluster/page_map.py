"""Inverted page map: page hash → which workers hold the page, and in which state, as bitsets.

The router walks a request's hash chain once for all workers: one dict lookup per page gives
four bitsets (bit i = the worker in slot i of the `ClusterIndex`). That keeps a decision at 64
workers one pass over the chain instead of 64.

    entry = (present, tomb, host_full, host_swa)      tomb, host_full, host_swa ⊆ present

| state (core/events.py) | tomb (SWA KV freed) | host_full (full KV on the host) | host_swa (SWA KV on the host) |
|---|---|---|---|
| LIVE           | 0 | 0 | 0 |
| TOMBSTONE      | 1 | 0 | 0 |
| SWA_HOST       | 0 | 0 | 1 |
| HOST           | 0 | 1 | 1 |
| HOST_TOMBSTONE | 1 | 1 | 0 |

Without a host tier the last two bitsets stay 0 for every page.
"""

from __future__ import annotations

from collections.abc import Callable

from core.events import PageState

PRESENT, TOMB, HOST_FULL, HOST_SWA = range(4)  # positions in an entry
Entry = tuple[int, int, int, int]

# (tomb, host_full, host_swa) of each state, the table above.
_FLAGS: dict[PageState, tuple[bool, bool, bool]] = {
    PageState.LIVE: (False, False, False),
    PageState.TOMBSTONE: (True, False, False),
    PageState.SWA_HOST: (False, False, True),
    PageState.HOST: (False, True, True),
    PageState.HOST_TOMBSTONE: (True, True, False),
}


class PageMap:
    """hash → (present, tomb, host_full, host_swa) bits; a hash no worker holds has no entry.

    NOTE: entries are tuples of ints, replaced on every change, not lists changed in place: the
    garbage collector untracks a tuple of ints once it survives a collection, so a map of
    millions of pages (64 workers × a GPU's cache) costs nothing to the full collections that
    otherwise stall a decision for tens of milliseconds while the index ingests.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, Entry] = {}

    def set(self, page_hash: int, bit: int, state: PageState) -> None:
        """Mark the page present for `bit`'s worker, in `state`."""
        entries = self._entries
        entry = entries.get(page_hash)
        tomb, host_full, host_swa = _FLAGS[state]
        if entry is None:
            entries[page_hash] = (bit, bit if tomb else 0, bit if host_full else 0, bit if host_swa else 0)
            return
        present, t, f, s = entry
        clear = ~bit
        entries[page_hash] = (
            present | bit,
            t | bit if tomb else t & clear,
            f | bit if host_full else f & clear,
            s | bit if host_swa else s & clear,
        )

    def drop(self, page_hash: int, bit: int) -> None:
        """Forget the page for `bit`'s worker (no-op when it was not there)."""
        entries = self._entries
        entry = entries.get(page_hash)
        if entry is None:
            return
        clear = ~bit
        present = entry[PRESENT] & clear
        if not present:
            del entries[page_hash]
        elif present != entry[PRESENT]:
            entries[page_hash] = (present, entry[TOMB] & clear, entry[HOST_FULL] & clear, entry[HOST_SWA] & clear)

    def get(self, page_hash: int) -> list[int] | None:
        """The [present, tomb, host_full, host_swa] bitsets (a copy)."""
        entry = self._entries.get(page_hash)
        return None if entry is None else list(entry)

    @property
    def lookup(self) -> Callable[[int], Entry | None]:
        """The entries' own `get`, for the matcher's per-page loop."""
        return self._entries.get

    def __len__(self) -> int:
        return len(self._entries)
