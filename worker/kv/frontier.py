"""The out-of-window SWA frontier of one request (docs/design.md §7).

A request's SWA KV at positions ``< pre_len - window`` is dead once the next query sits at
``pre_len``. The request frees it in page steps and remembers how far it got (``evicted``)::

    positions  0 ........ protected ............ evicted ........ new ....... pre_len
               |  tree-owned  |   already freed    | freed now     |  live SWA  |
               (never freed by the request)          table[evicted:new] -> free_swa

Rules, all pure integer arithmetic over the worker's `Geometry` (P = page size, W = window):
  * start  = max(evicted, protected, ceil_P(floor) if floor > protected) - never below the
    tree-owned prefix nor the pinned floor;
  * chunk cache: t = pre_len - W (no tree; the exact window);
  * radix cache: t = pre_len - max(W, P), capped at floor_P(pre_len + 1) - ceil_P(W) (see NOTE);
  * new = max(start, floor_P(t)): page aligned, monotone, never below `protected`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from core.geometry import Geometry
from worker.kv.allocator import check_page_size

if TYPE_CHECKING:
    from worker.kv.hybrid_allocator import HybridAllocator


def frontier_start(g: Geometry, *, evicted: int, protected: int, floor: int = 0) -> int:
    """Where the request's own freeing starts: past the tree-owned prefix and the pinned floor."""
    _check_aligned(g, evicted=evicted, protected=protected)
    lo = max(protected, floor)
    if lo > protected:
        lo = g.ceil(lo)  # a partly pinned page stays whole
    return max(evicted, lo)


def swa_frontier(
    g: Geometry, *, evicted: int, protected: int, pre_len: int, chunk_cache: bool, floor: int = 0
) -> int:
    """The new ``swa_evicted_seqlen`` for a request whose next query is at ``pre_len`` (pure)."""
    W, P = g.window, g.page_size
    if W is None:
        raise ValueError("no window: a geometry without sliding layers has no SWA frontier")
    start = frontier_start(g, evicted=evicted, protected=protected, floor=floor)
    if chunk_cache:
        threshold = pre_len - W
    else:
        # The margin max(W, P) keeps the frontier a page below the insert boundary
        # floor_P(pre_len + 1), so the last inserted leaf never becomes all-tombstone.
        threshold = pre_len - max(W, P)
        # NOTE: with W > P and W % P not in {0, P - 1} that margin alone can leave fewer than W
        # live tokens below the insert boundary (P=4, W=5, pre_len=10 -> 4, boundary 8: 4 live),
        # and the inserted leaf would fail the window match rule. Capping at boundary - ceil_P(W)
        # changes nothing in every other case and only ever frees less.
        threshold = min(threshold, g.floor(pre_len + 1) - g.ceil(W))
    return max(start, g.floor(threshold))


def free_out_of_window(
    allocator: HybridAllocator,
    table: torch.Tensor | Sequence[int],
    g: Geometry,
    *,
    evicted: int,
    protected: int,
    pre_len: int,
    chunk_cache: bool,
    floor: int = 0,
) -> int:
    """Free the SWA of ``table[start:new]`` (table = the request's full slots by position).

    Returns the new frontier (>= evicted). Idempotent for equal inputs: a second call finds the
    frontier already there and frees nothing.
    """
    if g.page_size != allocator.page_size:
        raise ValueError(f"page_size {g.page_size} != the allocator's {allocator.page_size}")
    start = frontier_start(g, evicted=evicted, protected=protected, floor=floor)
    new = swa_frontier(
        g,
        evicted=evicted,
        protected=protected,
        pre_len=pre_len,
        chunk_cache=chunk_cache,
        floor=floor,
    )
    if new > start:
        if new > len(table):
            raise ValueError(f"frontier {new} is past the request's table ({len(table)} slots)")
        allocator.free_swa(torch.as_tensor(table[start:new], dtype=torch.int64))
    return new


def live_spans_to_free(
    *, protected: int, floor: int, evicted: int, kv_len: int
) -> list[tuple[int, int]]:
    """Position spans a finishing request must still free when nothing records what it already
    freed (no mapping: the free is not idempotent), skipping the window-evicted hole.

    ``[protected, floor)`` was pinned (never window-evicted), ``[floor, evicted)`` is the hole,
    ``[evicted, kv_len)`` is live. E.g. protected 0, floor 3, evicted 6, kv_len 8 ->
    ``[(0, 3), (6, 8)]``.
    """
    if evicted <= floor:
        return [(protected, kv_len)] if kv_len > protected else []
    spans = []
    if floor > protected:
        spans.append((protected, min(floor, kv_len)))
    start = max(evicted, protected)
    if start < kv_len:
        spans.append((start, kv_len))
    return spans


def gather_spans(table: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``table`` entries of the given position spans, concatenated (1-D int64)."""
    parts = [torch.as_tensor(table[a:b], dtype=torch.int64) for a, b in spans]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _check_aligned(g: Geometry, *, evicted: int, protected: int) -> None:
    check_page_size(g.page_size)
    if protected % g.page_size:
        raise ValueError(f"protected={protected} (tree-owned prefix) must be page aligned")
    if evicted % g.page_size:
        raise ValueError(f"evicted={evicted} must be page aligned (frontiers move in pages)")


def steady_swa_per_request(window: int, interval: int, page_size: int) -> int:
    """SWA tokens a decoding request holds at most between two out-of-window frees: W + interval + P.

    The window it still reads, the `interval` tokens that may leave the window before the next
    periodic free, and the partly filled decode page.
    """
    return window + max(1, interval) + page_size
