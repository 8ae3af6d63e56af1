"""The tiered match per worker (docs/design.md §4.4), for all workers in one walk of the hash chain.

The worker's rule, mirrored exactly (`core.reuse.tiered_match` is the reference): for a chain
h_0..h_{n-1}, k pages are a *valid match* when pages 0..k-1 are all present and either none of
them lacks SWA KV (TOMBSTONE, HOST_TOMBSTONE) or the run of pages with SWA KV (on the device or
the host tier) ending at page k-1 covers at least `window` tokens (run = pages × page_size,
reset to 0 at every page without SWA). The *device* match applies the same rule to what needs no
load: it stops at the first page whose full KV is on the host, and only LIVE pages count in the
run. `window=None` (no SWA layer) is plain presence. P and the window are the worker's `Geometry`.

    pages:   L  L  T  L  SH SH L  H  H      present: 9 pages
             0  1  2  3  4  5  6  7  8
    p_valid:  run ending at page 8 = pages 3..8 (6 pages: SWA on either tier) → valid iff 6·P ≥ W
    p_device: stops before page 7 (full on the host); LIVE run ending at page 6 = 1 page
              → 7 iff P ≥ W, else 2 (no page without SWA KV before page 2)
    loads:    host_full = pages 7..8 below p_valid; host_swa = the host SWA among the
              ceil_P(W)/P pages before p_valid; host_full_all = every host-full page

The walk records, per worker, only where its page state *changes* (one record per run of equal
states: a prefix is a few long runs), then each worker's numbers come from its runs. A worker
whose pages are all LIVE has no record at all; its answer is its depth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from core.geometry import Geometry
from core.reuse import TieredMatch

# A run's state, from the PageMap bitsets (cluster/page_map.py): bit 0 SWA KV freed (tomb),
# bit 1 full KV on the host, bit 2 SWA KV on the host. 0 = LIVE.
_TOMB, _HOST_FULL, _HOST_SWA = 1, 2, 4
_NO_DEVICE_SWA = _TOMB | _HOST_SWA  # TOMBSTONE, SWA_HOST (and the host-full states)

Run = tuple[int, int]  # [start, end) in pages


class PageSource(Protocol):
    """What the walk reads: `cluster.page_map.PageMap`, or it with pending pages merged in
    (`router.pending.OverlaidPages`)."""

    @property
    def lookup(self) -> Callable[[int], list[int] | None]: ...


def deepest_valid(limit: int, bad: Sequence[Run], page_size: int, window: int | None) -> int:
    """Largest valid k ≤ limit, given the ascending runs of pages that break the run of SWA KV
    (all below `limit`). Between two bad runs the run of good pages only grows with k, so the
    deepest candidate of each stretch is the only one worth testing, last first."""
    if window is None:
        return limit
    upper = limit
    for start, end in reversed(bad):  # the last bad run below `upper`
        if (upper - end) * page_size >= window:
            return upper
        upper = start  # k ≤ start: pages 0..k-1 exclude this run
    return upper  # no bad page below: valid


def match_chain(
    hashes: Iterable[int], page_map: PageSource, geometries: Mapping[int, Geometry]
) -> dict[int, TieredMatch]:
    """Match one chain for the workers `geometries` names (worker bit → its geometry; all share
    the page size `hashes` was cut with) → bit → `TieredMatch` (tokens), with one dict get per
    page.

    `hashes` may be lazy: the walk stops pulling as soon as no target holds the next page.
    """
    alive = 0
    for bit in geometries:
        alive |= bit
    full_at: dict[int, int] = {}
    changes: dict[int, list[tuple[int, int]]] = {}  # bit → (page, state from it on)
    depth = 0
    get = page_map.lookup
    tomb0 = full0 = swa0 = 0  # the previous page's tomb / host_full / host_swa bits
    if alive:
        for page_hash in hashes:
            entry = get(page_hash)
            if entry is None:
                break
            still = alive & entry[0]
            if still != alive:
                _record_depth(alive & ~still, depth, full_at)
                alive = still
                if not alive:
                    break  # before pulling (hashing) the next page
            _, tomb, full, swa = entry
            if tomb != tomb0 or full != full0 or swa != swa0:
                _record_changes(
                    ((tomb ^ tomb0) | (full ^ full0) | (swa ^ swa0)) & alive,
                    depth, tomb, full, swa, changes,
                )  # fmt: skip
                tomb0, full0, swa0 = tomb, full, swa
            depth += 1
    _record_depth(alive, depth, full_at)
    out: dict[int, TieredMatch] = {}
    for bit, pages in full_at.items():
        geometry = geometries[bit]
        marks = changes.get(bit)
        if marks is None:  # LIVE all the way
            n = pages * geometry.page_size
            out[bit] = TieredMatch(n, n, n, 0, 0, 0)
        else:
            out[bit] = tiered_from_runs(pages, marks, geometry)
    return out


def tiered_from_runs(pages: int, marks: list[tuple[int, int]], g: Geometry) -> TieredMatch:
    """One worker's `TieredMatch` from its depth and where its page state changes (ascending
    `(page, state)` below `pages`, LIVE before the first)."""
    ends = [page for page, _ in marks[1:]] + [pages]
    runs = [(start, end, state) for (start, state), end in zip(marks, ends)]  # non-empty
    P, W = g.page_size, g.window
    valid = deepest_valid(pages, [(s, e) for s, e, state in runs if state & _TOMB], P, W)
    device_end = next((s for s, _, state in runs if state & _HOST_FULL), pages)
    device_bad = [(s, e) for s, e, state in runs if state & _NO_DEVICE_SWA and e <= device_end]
    device = deepest_valid(device_end, device_bad, P, W)
    window_start = valid - (0 if W is None else g.ceil(W) // P)
    host_full = host_full_all = host_swa = 0
    for s, e, state in runs:
        if state & _HOST_FULL:
            host_full += _overlap(s, e, 0, valid)
            host_full_all += e - s
        if state & _HOST_SWA:
            host_swa += _overlap(s, e, window_start, valid)
    return TieredMatch(pages * P, valid * P, device * P, host_full * P, host_swa * P, host_full_all * P)


def _overlap(start: int, end: int, lo: int, hi: int) -> int:
    n = min(end, hi) - max(start, lo)
    return n if n > 0 else 0


def _record_changes(
    bits: int, depth: int, tomb: int, full: int, swa: int, out: dict[int, list[tuple[int, int]]]
) -> None:
    while bits:
        low = bits & -bits
        state = (_TOMB if tomb & low else 0) | (_HOST_FULL if full & low else 0)
        out.setdefault(low, []).append((depth, state | (_HOST_SWA if swa & low else 0)))
        bits ^= low


def _record_depth(bits: int, depth: int, out: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        out[low] = depth
        bits ^= low
