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

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from cluster.page_map import Entry
from core.geometry import Geometry
from core.reuse import TieredMatch

# A run's state, from the PageMap bitsets (cluster/page_map.py): bit 0 SWA KV freed (tomb),
# bit 1 full KV on the host, bit 2 SWA KV on the host. 0 = LIVE.
_TOMB, _HOST_FULL, _HOST_SWA = 1, 2, 4
_NO_DEVICE_SWA = _TOMB | _HOST_SWA  # TOMBSTONE, SWA_HOST (and the host-full states)
_HOSTED = _HOST_FULL | _HOST_SWA
# NOTE: `tuple.__new__(NamedTupleClass, values)` builds the same value as the class call at a
# third of its cost (the generated __new__ is Python code); every field must be given.
_new = tuple.__new__


class PageSource(Protocol):
    """What the walk reads: `cluster.page_map.PageMap`, or it with pending pages merged in
    (`router.pending.OverlaidPages`)."""

    @property
    def lookup(self) -> Callable[[int], Entry | None]: ...


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
    hosted = 0  # workers with host KV along their match
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
            if tomb != tomb0 or full != full0 or swa != swa0:  # some worker's state changes here
                bits = ((tomb ^ tomb0) | (full ^ full0) | (swa ^ swa0)) & alive
                hosted |= (full | swa) & alive
                while bits:  # NOTE: inline, no helper call: once per run per worker
                    low = bits & -bits
                    state = (_TOMB if tomb & low else 0) | (_HOST_FULL if full & low else 0)
                    state |= _HOST_SWA if swa & low else 0
                    marks = changes.get(low)
                    if marks is None:
                        changes[low] = [(depth, state)]
                    else:
                        marks.append((depth, state))
                    bits ^= low
                tomb0, full0, swa0 = tomb, full, swa
            depth += 1
    _record_depth(alive, depth, full_at)
    out: dict[int, TieredMatch] = {}
    live: dict[tuple[int, int], TieredMatch] = {}  # one answer for every all-LIVE depth
    for bit, pages in full_at.items():
        g = geometries[bit]
        marks = changes.get(bit)
        if marks is None:  # LIVE all the way
            key = (pages, g.page_size)
            m = live.get(key)
            if m is None:
                n = pages * g.page_size
                m = live[key] = TieredMatch(n, n, n, 0, 0, 0)
            out[bit] = m
        elif bit & hosted:
            out[bit] = _tiered(pages, marks, g.page_size, g.window)
        else:  # device only: the device match is the valid one, nothing to load
            valid = _valid(pages, marks, g.page_size, g.window) * g.page_size
            out[bit] = _new(TieredMatch, (pages * g.page_size, valid, valid, 0, 0, 0))
    return out


# NOTE: the two below run once per worker with a non-LIVE page, per decision: plain loops
# over its runs, last first, no helper calls. Between two runs that break a match the usable
# run only grows with k, so the deepest candidate of each stretch is the only one to test.


def _valid(pages: int, marks: list[tuple[int, int]], P: int, W: int | None) -> int:
    """The deepest valid match (pages) of a worker whose runs are LIVE or TOMBSTONE."""
    if W is None:
        return pages
    upper = end = pages
    for start, state in reversed(marks):
        if state:  # a tombstone run, the last one below `upper`
            if (upper - end) * P >= W:
                return upper
            upper = start  # k ≤ start: pages 0..k-1 exclude this run
        end = start
    return upper


def _tiered(pages: int, marks: list[tuple[int, int]], P: int, W: int | None) -> TieredMatch:
    """`TieredMatch` of a worker holding host KV along the chain: the valid match (over SWA
    on either tier), the device match (before the first host-full run, LIVE pages only), then
    the host counts below the valid match."""
    valid = upper_v = device = upper_d = end = pages
    found_v = found_d = W is None
    host_full_all = 0
    for start, state in reversed(marks):
        if not found_v and state & _TOMB:  # the last tombstone run below `upper_v`
            if (upper_v - end) * P >= W:  # type: ignore[operator]  # W is set: not found
                valid, found_v = upper_v, True
            else:
                valid = upper_v = start
        if state & _HOST_FULL:  # the device match ends before the first host-full run
            host_full_all += end - start
            device = upper_d = start
            found_d = W is None
        elif not found_d and state & _NO_DEVICE_SWA:
            if (upper_d - end) * P >= W:  # type: ignore[operator]  # W is set: not found
                device, found_d = upper_d, True
            else:
                device = upper_d = start
        end = start
    window_start = valid if W is None else valid + (-W // P)  # valid − ceil_P(W)/P pages
    host_full = host_swa = 0
    end = pages
    for start, state in reversed(marks):
        if state & _HOSTED and start < valid:
            top = end if end < valid else valid
            if state & _HOST_FULL:
                host_full += top - start
            if state & _HOST_SWA and top > window_start:
                host_swa += top - (start if start > window_start else window_start)
        end = start
    return _new(TieredMatch, (pages * P, valid * P, device * P, host_full * P, host_swa * P, host_full_all * P))


def _record_depth(bits: int, depth: int, out: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        out[low] = depth
        bits ^= low
