"""Inverted page map: page hash → which workers hold the page, and which hold it as a tombstone.

The router walks a request's hash chain once for all workers: one dict lookup per page gives two
bitsets (bit i = the worker in slot i of the `ClusterIndex`). That keeps a decision at 64
workers one pass over the chain instead of 64.

    entry = [present, tomb]     present: LIVE or TOMBSTONE;  tomb ⊆ present: TOMBSTONE only
"""

from __future__ import annotations

from collections.abc import Callable


class PageMap:
    """hash → [present_bits, tomb_bits]; a hash no worker holds has no entry."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, list[int]] = {}

    def set(self, page_hash: int, bit: int, live: bool) -> None:
        """Mark the page present for `bit`'s worker, LIVE or TOMBSTONE."""
        entry = self._entries.get(page_hash)
        if entry is None:
            self._entries[page_hash] = [bit, 0 if live else bit]
            return
        entry[0] |= bit
        if live:
            entry[1] &= ~bit
        else:
            entry[1] |= bit

    def drop(self, page_hash: int, bit: int) -> None:
        """Forget the page for `bit`'s worker (no-op when it was not there)."""
        entry = self._entries.get(page_hash)
        if entry is None:
            return
        entry[0] &= ~bit
        entry[1] &= ~bit
        if not entry[0]:
            del self._entries[page_hash]

    def get(self, page_hash: int) -> list[int] | None:
        """The [present, tomb] bitsets; callers must not mutate them."""
        return self._entries.get(page_hash)

    @property
    def lookup(self) -> Callable[[int], list[int] | None]:
        """`get` without the method call, for the matcher's per-page loop (read-only use)."""
        return self._entries.get

    def __len__(self) -> int:
        return len(self._entries)
