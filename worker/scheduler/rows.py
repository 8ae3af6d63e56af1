"""Rows of the runner's device page table (docs/design.md §18.1): one per live `ReqKV`, given
back when it is dropped and reused (lowest first) by the next admission."""

from __future__ import annotations

import heapq


class PageRows:
    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def give(self, row: int) -> None:
        heapq.heappush(self._free, row)

    def check(self, held: list[int]) -> None:
        """`held` (the running requests' rows) and the free rows are every row handed out, once."""
        if sorted(held + self._free) != list(range(self._next)) or min(held, default=0) < 0:
            raise AssertionError(
                f"page-table rows: running requests hold {sorted(held)}, free {sorted(self._free)}, "
                f"{self._next} handed out (a row leaked or is shared)"
            )
