"""Page arithmetic: every rounding to page boundaries goes through these two functions.

    positions:  0      P      2P     3P
                |------|------|------|--
    x = 2P + 3:               ^floor_page(x) = 2P   ^ceil_page(x) = 3P
"""

from __future__ import annotations


def floor_page(x: int, page_size: int) -> int:
    """floor_P(x): the largest multiple of page_size <= x (also for negative x)."""
    return (x // page_size) * page_size


def ceil_page(x: int, page_size: int) -> int:
    """ceil_P(x): the smallest multiple of page_size >= x."""
    return -(-x // page_size) * page_size
