"""Page arithmetic, and `Geometry`: the shape of one worker's KV that every rule about reuse
depends on.

Every rounding to page boundaries goes through `floor_page` / `ceil_page`::

    positions:  0      P      2P     3P
                |------|------|------|--
    x = 2P + 3:               ^floor_page(x) = 2P   ^ceil_page(x) = 3P

The page size, the window (keys to the left of a query on an SWA layer, docs/design.md §1; None
when no layer slides) and the number of SWA layers travel together from the model and the
engine config to the scheduler, the cache, the cluster index and the router, as one value.
"""

from __future__ import annotations

from dataclasses import dataclass


def floor_page(x: int, page_size: int) -> int:
    """floor_P(x): the largest multiple of page_size <= x (also for negative x)."""
    return (x // page_size) * page_size


def ceil_page(x: int, page_size: int) -> int:
    """ceil_P(x): the smallest multiple of page_size >= x."""
    return -(-x // page_size) * page_size


@dataclass(frozen=True, slots=True)
class Geometry:
    page_size: int
    window: int | None  # keys to the left; None when no layer slides
    swa_layers: int = 0  # SWA layers of the model (the repair rule's n_swa)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"window must be >= 0 (keys to the left), got {self.window}")
        if self.swa_layers < 0:
            raise ValueError(f"swa_layers must be >= 0, got {self.swa_layers}")

    @property
    def slides(self) -> bool:
        """Some layer has a window: SWA KV dies as it leaves it."""
        return self.window is not None and self.swa_layers > 0

    def ceil(self, n: int) -> int:
        """`n` rounded up to a whole page."""
        return ceil_page(n, self.page_size)

    def floor(self, n: int) -> int:
        """`n` rounded down to a whole page."""
        return floor_page(n, self.page_size)
