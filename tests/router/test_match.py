"""Tiered match (docs/design.md §4.4): the fast walk agrees with the literal rule and with the
reference walk `core.reuse.tiered_match` on every layout of states over both tiers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from match_oracle import valid_match_reference

from cluster.page_map import PageMap
from core.events import PageState
from core.geometry import Geometry
from core.reuse import TieredMatch, tiered_match
from router.match import match_chain

L, T, SH, H, HT = (PageState.LIVE, PageState.TOMBSTONE, PageState.SWA_HOST, PageState.HOST,
                   PageState.HOST_TOMBSTONE)  # fmt: skip


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
    out, _ = _walk([[T, L, L, L], [T, L, L]], [Geometry(2, 5), Geometry(2, 5)])
    assert out[1].p_valid == 8 and out[2].p_valid == 0


_states = st.lists(st.sampled_from([L, T, None]), max_size=24)


@settings(max_examples=300, deadline=None)
@given(_states, st.sampled_from([1, 2, 4]), st.one_of(st.none(), st.integers(0, 12)))
def test_valid_match_equals_the_literal_rule(states: list, page: int, window: int | None) -> None:
    """Jumping between runs of tombstones gives the same answer as testing every k."""
    out, _ = _walk([states + [None]], [Geometry(page, window)])
    got = out[1].p_valid if 1 in out else 0
    assert got == valid_match_reference(states, page, window) * page


_tiered_states = st.lists(st.sampled_from([L, T, SH, H, HT, None]), max_size=20)


def _walk(worker_states: list[list], geometries: list[Geometry]) -> tuple[dict[int, TieredMatch], int]:
    depth = max(len(s) for s in worker_states)
    chain = list(range(100, 100 + depth))
    page_map = PageMap()
    for slot, states in enumerate(worker_states):
        for h, state in zip(chain, states):
            if state is not None:
                page_map.set(h, 1 << slot, state)
    bits = {1 << slot: g for slot, g in enumerate(geometries)}
    return match_chain(iter(chain), page_map, bits), depth


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_tiered_states, st.one_of(st.none(), st.integers(0, 12))), min_size=1, max_size=6),
    st.sampled_from([1, 2, 4]),
)
def test_match_chain_equals_the_reference_walk(workers: list[tuple[list, int | None]], page: int) -> None:
    """One walk over the PageMap gives each worker exactly `tiered_match` of its own states:
    p_full, p_valid over device ∪ host SWA, p_device, host_full, host_swa, host_full_all."""
    geometries = [Geometry(page, window, 2 if window is not None else 0) for _, window in workers]
    out, depth = _walk([s for s, _ in workers], geometries)
    for slot, ((states, _), g) in enumerate(zip(workers, geometries)):
        padded = states + [None] * (depth - len(states))
        want = tiered_match(padded, g)
        got = out.get(1 << slot, TieredMatch(0, 0, 0, 0, 0, 0))
        assert got == want, (states, g)


def test_worked_example_of_the_docstring() -> None:
    """router/match.py's example, page 4, window 8."""
    out, _ = _walk([[L, L, T, L, SH, SH, L, H, H]], [Geometry(4, 8, 2)])
    assert out[1] == TieredMatch(p_full=36, p_valid=36, p_device=8, host_full=8, host_swa=8, host_full_all=8)


def test_match_chain_stops_pulling_hashes() -> None:
    """The lazy chain is consumed only one page past the deepest holder."""
    page_map = PageMap()
    page_map.set(1, 1, L)
    pulled: list[int] = []

    def chain():
        for h in range(1, 1000):
            pulled.append(h)
            yield h

    out = match_chain(chain(), page_map, {1: Geometry(4, None)})
    assert out[1].p_full == 4 and pulled == [1, 2]


def test_match_chain_ignores_other_workers_bits() -> None:
    """Pages held only by non-target workers do not extend a target's match, and their states
    do not leak into it."""
    page_map = PageMap()
    page_map.set(1, 0b01, L)
    page_map.set(1, 0b10, H)
    page_map.set(2, 0b10, H)
    out = match_chain(iter([1, 2]), page_map, {0b01: Geometry(2, 4)})
    assert out == {0b01: TieredMatch(2, 2, 2, 0, 0, 0)}
