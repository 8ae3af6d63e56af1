"""`PageAllocator`: the free-page list of ONE pool, in plain Python (numpy only for a view).

Page p holds slots ``[p * page_size, (p + 1) * page_size)``. Page 0 is the reserved dummy page
(padded tokens write there), so the usable pages are ``1 .. num_pages`` and page 0 never enters
the free list. Double frees are detected (a per-page "is free" flag) instead of corrupting the
list, and every mutation validates its whole input first, so an error leaves the state untouched.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np


def check_page_size(page_size: int) -> None:
    """Raise ValueError unless page_size is a positive power of two."""
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise ValueError(f"page_size must be an int, got {page_size!r}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(
            f"page_size must be a power of two (1, 2, 4, 8, 16, ...), got {page_size}; "
            "pick the nearest power of two"
        )


def check_pool_size(name: str, size: int, page_size: int) -> None:
    """Raise ValueError unless `size` tokens is a positive whole number of pages."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise ValueError(f"{name} must be an int number of tokens, got {size!r}")
    if size < page_size:
        raise ValueError(
            f"{name}={size} tokens holds no page of page_size={page_size}; "
            f"give it at least {page_size} tokens"
        )
    if size % page_size:
        raise ValueError(
            f"{name}={size} is not a multiple of page_size={page_size}; "
            f"round it down to {size - size % page_size}"
        )


class PageAllocator:
    """Free list over pages ``1 .. num_pages`` of one pool. O(pages) per call."""

    def __init__(self, num_pages: int, page_size: int, name: str = "pool") -> None:
        check_page_size(page_size)
        if num_pages < 1:
            raise ValueError(f"{name}: needs at least one usable page, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.name = name
        self.clear()

    def clear(self) -> None:
        """Every usable page free again; page 0 stays reserved."""
        self._free: deque[int] = deque(range(1, self.num_pages + 1))
        # NOTE: index 0 is page 0, permanently "not free" so it can never be freed or handed out.
        self._is_free = bytearray([0]) + bytearray([1]) * self.num_pages

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def capacity(self) -> int:
        """Allocatable tokens (page 0 excluded)."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def is_allocated(self, page: int) -> bool:
        return 1 <= page <= self.num_pages and not self._is_free[page]

    def free_flags(self) -> bytes:
        """Byte p is 1 iff page p is free (page 0 always 0); for vectorised integrity checks."""
        return bytes(self._is_free)

    def free_flag_view(self) -> np.ndarray:
        """`free_flags` as a uint8 array sharing the flags' memory (no copy; read it at once:
        `clear` replaces the flags)."""
        return np.frombuffer(self._is_free, dtype=np.uint8)

    def free_pages(self) -> list[int]:
        """A copy of the free list in allocation order (for snapshots and tests)."""
        return list(self._free)

    # ---- mutations --------------------------------------------------------------------------
    def alloc(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages from the head of the free list; None (no change) if short."""
        if num_pages < 0:
            raise ValueError(f"{self.name}: cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return distinct allocated pages to the tail of the free list.

        Raises ValueError (and changes nothing) on page 0, an out-of-range page, a page listed
        twice, or a page that is already free (a double free).
        """
        pages = list(pages)
        self.check_freeable(pages)
        for p in pages:
            self._is_free[p] = 1
        self._free.extend(pages)

    def check_freeable(self, pages: list[int]) -> None:
        seen: set[int] = set()
        for p in pages:
            if p == 0:
                raise ValueError(f"{self.name}: refusing to free reserved page 0")
            if not 1 <= p <= self.num_pages:
                raise ValueError(f"{self.name}: page {p} is outside 1..{self.num_pages}")
            if p in seen:
                raise ValueError(f"{self.name}: page {p} listed twice in one free")
            if self._is_free[p]:
                raise ValueError(f"{self.name}: double free of page {p} (it is already free)")
            seen.add(p)

    # ---- invariants -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Free list and flags agree; no duplicates; page 0 never free; free + used = total."""
        free = list(self._free)
        where = f"{self.name} allocator"
        if len(set(free)) != len(free):
            raise AssertionError(f"{where}: a page appears twice in the free list")
        if 0 in free or self._is_free[0]:
            raise AssertionError(f"{where}: reserved page 0 is in the free list")
        if any(not 1 <= p <= self.num_pages for p in free):
            raise AssertionError(f"{where}: free list holds an out-of-range page")
        # in-use pages are the flagged-not-free ones: free + in-use = capacity iff they agree.
        if sum(self._is_free) != len(free) or any(not self._is_free[p] for p in free):
            raise AssertionError(
                f"{where}: free flags disagree with the free list "
                f"(free + in-use != capacity {self.num_pages} pages)"
            )
