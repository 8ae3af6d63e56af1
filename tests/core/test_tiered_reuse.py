"""The shared reuse rule across tiers (core/reuse.py, docs/design.md §9.9) and the page-state
transitions the cache events make (core/events.py)."""

from __future__ import annotations

import pytest

from core.events import CacheEvent, EventKind, PageState, replay
from core.geometry import Geometry
from core.reuse import Reuse, TierCosts, TieredMatch, choose_reuse, plan_reuse, tiered_match

L, T, SH, H, HT = (PageState.LIVE, PageState.TOMBSTONE, PageState.SWA_HOST, PageState.HOST,
                   PageState.HOST_TOMBSTONE)  # fmt: skip
G = Geometry(page_size=4, window=8, swa_layers=2)  # R = ceil4(8 + 8) = 16
COSTS = TierCosts(prefill=1.0, load_full=0.1, load_swa=0.05)


def test_without_a_host_tier_it_is_plan_reuse() -> None:
    """No host pages (p_device = p_valid): choose_reuse equals the repair rule everywhere."""
    for p_full in range(0, 120, 4):
        for p_valid in range(0, p_full + 1, 4):
            m = TieredMatch(p_full, p_valid, p_valid, 0, 0, 0)
            for repair in (False, True):
                assert choose_reuse(m, G, COSTS, repair=repair) == plan_reuse(p_full, p_valid, G, repair=repair)


def test_tiered_match_walks_states() -> None:
    """Validity counts SWA on either tier; the device-only match stops at host KV; loads are the
    host full pages below p_valid and the host SWA pages of the window before it."""
    m = tiered_match([L, T, L, SH, SH, L, None, L], G)
    # present 6 pages; valid at 6 (run L,SH,SH,L... after the tombstone = 4 pages = 16 >= 8)
    assert m == TieredMatch(p_full=24, p_valid=24, p_device=4, host_full=0, host_swa=4, host_full_all=0)
    m = tiered_match([H, H, H, HT, L, L], G)
    assert (m.p_full, m.p_valid, m.p_device, m.host_full, m.host_swa, m.host_full_all) == (24, 24, 0, 16, 0, 16)
    assert tiered_match([L, L, L], Geometry(4, None, 0)).p_valid == 12


def test_load_wins_when_cheaper_than_recomputing() -> None:
    """A host-resident prefix is loaded; with loads dearer than prefill it is recomputed."""
    m = tiered_match([H, H, H, H, SH, SH], G)
    assert choose_reuse(m, G, COSTS, repair=True) == Reuse(24, 0, 16, 8)
    dear = TierCosts(prefill=1.0, load_full=5.0, load_swa=5.0)
    assert choose_reuse(m, G, dear, repair=True) == Reuse(0)


def test_repair_against_load() -> None:
    """A long full match past a short valid one: the repair (loading its host full KV) wins
    when it saves more than twice its rows."""
    states = [L, L] + [T] * 10 + [HT] * 10
    m = tiered_match(states, G)
    assert (m.p_full, m.p_valid, m.host_full_all) == (88, 8, 40)
    assert choose_reuse(m, G, COSTS, repair=True) == Reuse(88 - 16, 16, 40, 0)
    assert choose_reuse(m, G, COSTS, repair=False) == Reuse(8)


@pytest.mark.parametrize(
    ("kind", "before", "after"),
    [
        (EventKind.SWA_OFFLOADED, L, SH),
        (EventKind.SWA_LOADED, SH, L),
        (EventKind.OFFLOADED, L, H),
        (EventKind.OFFLOADED, SH, H),
        (EventKind.OFFLOADED, T, HT),
        (EventKind.LOADED, H, SH),
        (EventKind.LOADED, HT, T),
        (EventKind.SWA_REMOVED, SH, T),
        (EventKind.SWA_REMOVED, H, HT),
        (EventKind.REMOVED, HT, None),
    ],
)
def test_tier_events_replay(kind: EventKind, before: PageState, after: PageState | None) -> None:
    """Each tier event moves a page from `before` to `after`; one from a state it cannot come
    from is refused (the consumer resyncs)."""
    pages = replay([CacheEvent(kind, (7,))], {7: before})
    assert pages.get(7) == after
    with pytest.raises(ValueError, match="out of sync"):
        replay([CacheEvent(kind, (7,))], {} if before is not None else {7: L})
