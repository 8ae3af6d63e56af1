"""The valid match per worker (docs/design.md §4.4), for all workers in one walk of the hash chain.

The worker's rule, mirrored exactly: for a chain h_0..h_{n-1}, k pages are a *valid match* when
pages 0..k-1 are all present (LIVE or TOMBSTONE) and either none of them is a TOMBSTONE or the
run of LIVE pages ending at page k-1 covers at least `window` tokens (run = pages × page_size,
reset to 0 at every tombstone). The answer is the largest valid k (k = 0 is always valid);
`window=None` (no SWA layer) is plain full presence. P and the window are the worker's
`Geometry`.

    pages:   L  L  T  L  L  L  T  L  L      full presence: 9 pages
             0  1  2  3  4  5  6  7  8
    k = 9:   run ending at page 8 = pages 7..8 (2 pages)  → valid iff 2·P ≥ window
    k = 6:   run ending at page 5 = pages 3..5 (3 pages)  → valid iff 3·P ≥ window
    k = 2:   no tombstone in pages 0..1                    → always valid

`deepest_valid` jumps from tombstone to tombstone instead of testing every k: between two
tombstones the run only grows with k, so the deepest candidate of each stretch is the only one
worth testing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple, Protocol

from core.geometry import Geometry


class PageSource(Protocol):
    """What the walk reads: `cluster.page_map.PageMap`, or it with pending pages merged in
    (`router.pending.OverlaidPages`)."""

    @property
    def lookup(self) -> Callable[[int], list[int] | None]: ...


class WorkerMatch(NamedTuple):
    """NOTE: NamedTuple, not a frozen dataclass: one per worker per request, and a frozen
    dataclass costs twice as much to build (it adds up to a third of a 64-worker decision)."""

    full_pages: int  # pages present from the root: what an SWA-unaware router would count
    valid_pages: int  # pages the worker can really reuse (≤ full_pages)


def deepest_valid(full_pages: int, tombstones: Sequence[int], geometry: Geometry) -> int:
    """Largest valid k ≤ full_pages, given the ascending tombstone positions below full_pages."""
    window = geometry.window
    if window is None or not tombstones:
        return full_pages
    page_size = geometry.page_size
    upper = full_pages
    for tomb in reversed(tombstones):  # `tomb` is the last tombstone below `upper`
        if (upper - 1 - tomb) * page_size >= window:
            return upper
        upper = tomb  # k ≤ tomb: pages 0..k-1 exclude this tombstone
    return upper  # no tombstone below: valid


def match_chain(
    hashes: Iterable[int], page_map: PageSource, geometries: Mapping[int, Geometry]
) -> dict[int, WorkerMatch]:
    """Match one chain for the workers `geometries` names (worker bit → its geometry; all share
    the page size `hashes` was cut with) → bit → WorkerMatch, with one dict get per page.

    `hashes` may be lazy: the walk stops pulling as soon as no target holds the next page.
    """
    alive = 0
    for bit in geometries:
        alive |= bit
    full_at: dict[int, int] = {}
    tombs: dict[int, list[int]] = {}
    depth = 0
    get = page_map.lookup
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
            tomb = entry[1]
            if tomb:
                tomb &= alive
            while tomb:
                low = tomb & -tomb
                tombs.setdefault(low, []).append(depth)
                tomb ^= low
            depth += 1
    _record_depth(alive, depth, full_at)
    return {
        bit: WorkerMatch(full, deepest_valid(full, tombs.get(bit, ()), geometries[bit]))
        for bit, full in full_at.items()
    }


def _record_depth(bits: int, depth: int, out: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        out[low] = depth
        bits ^= low
