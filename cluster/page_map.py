"""Inverted page map: page hash → which workers hold the page, and in which state, as bitsets.

The router walks a request's hash chain once for all workers: one dict lookup per page gives
four bitsets (bit i = the worker in slot i of the `ClusterIndex`). That keeps a decision at 64
workers one pass over the chain instead of 64.

    entry = [present, tomb, host_full, host_swa]      tomb, host_full, host_swa ⊆ present

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

# (tomb, host_full, host_swa) of each state, the table above.
_FLAGS: dict[PageState, tuple[bool, bool, bool]] = {
    PageState.LIVE: (False, False, False),
    PageState.TOMBSTONE: (True, False, False),
    PageState.SWA_HOST: (False, False, True),
    PageState.HOST: (False, True, True),
    PageState.HOST_TOMBSTONE: (True, True, False),
}


class PageMap:
    """hash → [present, tomb, host_full, host_swa] bits; a hash no worker holds has no entry."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, list[int]] = {}

    def set(self, page_hash: int, bit: int, state: PageState) -> None:
        """Mark the page present for `bit`'s worker, in `state`."""
        entry = self._entries.get(page_hash)
        if entry is None:
            entry = self._entries[page_hash] = [bit, 0, 0, 0]
        else:
            entry[PRESENT] |= bit
        tomb, host_full, host_swa = _FLAGS[state]
        clear = ~bit
        entry[TOMB] = entry[TOMB] | bit if tomb else entry[TOMB] & clear
        entry[HOST_FULL] = entry[HOST_FULL] | bit if host_full else entry[HOST_FULL] & clear
        entry[HOST_SWA] = entry[HOST_SWA] | bit if host_swa else entry[HOST_SWA] & clear

    def drop(self, page_hash: int, bit: int) -> None:
        """Forget the page for `bit`'s worker (no-op when it was not there)."""
        entry = self._entries.get(page_hash)
        if entry is None:
            return
        clear = ~bit
        entry[PRESENT] &= clear
        if not entry[PRESENT]:
            del self._entries[page_hash]
            return
        entry[TOMB] &= clear
        entry[HOST_FULL] &= clear
        entry[HOST_SWA] &= clear

    def get(self, page_hash: int) -> list[int] | None:
        """The [present, tomb, host_full, host_swa] bitsets; callers must not mutate them."""
        return self._entries.get(page_hash)

    @property
    def lookup(self) -> Callable[[int], list[int] | None]:
        """`get` without the method call, for the matcher's per-page loop (read-only use)."""
        return self._entries.get

    def __len__(self) -> int:
        return len(self._entries)
