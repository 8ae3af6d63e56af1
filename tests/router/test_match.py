"""Valid match (docs/design.md §4.4): the fast walk agrees with the literal rule and the index."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from match_oracle import valid_match_reference

from cluster.page_map import PageMap
from core.events import PageState
from core.geometry import Geometry
from router.match import deepest_valid, match_chain

L, T = PageState.LIVE, PageState.TOMBSTONE


def test_reference_examples() -> None:
    """Hand-checked cases with page 2, window 4 (two LIVE pages must end the match)."""
    assert valid_match_reference([L, L, L], 2, 4) == 3
    assert valid_match_reference([T, L, L], 2, 4) == 3
    assert valid_match_reference([T, L], 2, 4) == 0  # run of 2 tokens < 4, no earlier point
    assert valid_match_reference([L, T, L], 2, 4) == 1  # falls back before the tombstone
    assert valid_match_reference([L, L, T, L, L, None, L], 2, 4) == 5
    assert valid_match_reference([T, T], 2, None) == 2  # no window: full presence


def test_window_not_page_aligned() -> None:
    """A window of 5 tokens at page 2 needs three LIVE pages after a tombstone."""
    assert valid_match_reference([T, L, L], 2, 5) == 0
    assert valid_match_reference([T, L, L, L], 2, 5) == 4
    assert deepest_valid(4, [0], Geometry(2, 5)) == 4 and deepest_valid(3, [0], Geometry(2, 5)) == 0


_states = st.lists(st.sampled_from([L, T, None]), max_size=24)


@settings(max_examples=300, deadline=None)
@given(_states, st.sampled_from([1, 2, 4]), st.one_of(st.none(), st.integers(0, 12)))
def test_deepest_valid_matches_reference(states: list, page: int, window: int | None) -> None:
    """Jumping between tombstones gives the same answer as testing every k."""
    full = next((i for i, s in enumerate(states) if s is None), len(states))
    tombs = [i for i, s in enumerate(states[:full]) if s is T]
    assert deepest_valid(full, tombs, Geometry(page, window)) == valid_match_reference(states, page, window)


@settings(max_examples=100, deadline=None)
@given(st.lists(_states, min_size=1, max_size=5), st.integers(0, 9))
def test_match_chain_per_worker(worker_states: list[list], window: int) -> None:
    """One walk over the PageMap gives each worker its own full and valid match."""
    depth = max(len(s) for s in worker_states)
    chain = list(range(100, 100 + depth))
    page_map = PageMap()
    geometries = {}
    for slot, states in enumerate(worker_states):
        bit = 1 << slot
        geometries[bit] = Geometry(2, window)
        for h, state in zip(chain, states):
            if state is not None:
                page_map.set(h, bit, state is L)
    out = match_chain(iter(chain), page_map, geometries)
    for slot, states in enumerate(worker_states):
        padded = states + [None] * (depth - len(states))
        full = next((i for i, s in enumerate(padded) if s is None), depth)
        assert out[1 << slot].full_pages == full
        assert out[1 << slot].valid_pages == valid_match_reference(padded, 2, window)


def test_match_chain_stops_pulling_hashes() -> None:
    """The lazy chain is consumed only one page past the deepest holder."""
    page_map = PageMap()
    page_map.set(1, 1, True)
    pulled: list[int] = []

    def chain():
        for h in range(1, 1000):
            pulled.append(h)
            yield h

    out = match_chain(chain(), page_map, {1: Geometry(4, None)})
    assert out[1].full_pages == 1 and pulled == [1, 2]


def test_match_chain_ignores_other_workers_bits() -> None:
    """Pages held only by non-target workers do not extend a target's match."""
    page_map = PageMap()
    page_map.set(1, 0b01, True)
    page_map.set(1, 0b10, True)
    page_map.set(2, 0b10, True)
    out = match_chain(iter([1, 2]), page_map, {0b01: Geometry(2, 4)})
    assert out == {0b01: out[0b01]} and out[0b01].full_pages == 1
