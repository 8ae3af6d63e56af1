"""The repair rule shared by the scheduler and the router (docs/design.md §9.8)."""

from __future__ import annotations

import pytest

from core.geometry import Geometry
from core.reuse import Reuse, plan_reuse, repair_rows


@pytest.mark.parametrize(
    "window,swa_layers,page,rows",
    [
        (127, 18, 16, 2288),  # GPT-OSS-120B: ceil16(128 + 17 * 127) = ceil16(2287)
        (128, 39, 16, 4992),  # MiMo-V2-Flash: 128 + 38 * 128 = 4992
        (4, 1, 4, 4),  # one SWA layer: just the page-rounded window
        (5, 2, 4, 16),  # ceil4(ceil4(5) + 5) = ceil4(13)
        (16, 2, 1, 32),
    ],
)
def test_repair_rows(window: int, swa_layers: int, page: int, rows: int) -> None:
    """R = ceil_P(ceil_P(W) + (n_swa - 1) W), and never more than a page over ceil_P(n_swa W)."""
    assert repair_rows(Geometry(page, window, swa_layers)) == rows
    plain = -(-swa_layers * window // page) * page
    assert plain <= rows <= plain + page


def test_repair_only_when_it_costs_at_most_half_of_what_it_saves() -> None:
    """R <= (p_full - p_valid) / 2, else the valid match; off, no window or no gap: valid."""
    g = Geometry(page_size=4, window=16, swa_layers=2)  # R = 32
    assert plan_reuse(200, 100, g, repair=True) == Reuse(168, 32)
    assert plan_reuse(164, 100, g, repair=True) == Reuse(132, 32)  # gap 64 = 2R
    assert plan_reuse(160, 100, g, repair=True) == Reuse(100)  # gap 60 < 2R
    assert plan_reuse(200, 100, g, repair=False) == Reuse(100)
    assert plan_reuse(200, 200, g, repair=True) == Reuse(200)
    assert plan_reuse(200, 0, Geometry(4, None, 2), repair=True) == Reuse(0)
    assert plan_reuse(200, 0, Geometry(4, 16, 0), repair=True) == Reuse(0)


def test_reuse_never_starts_before_the_valid_match() -> None:
    """Whenever it repairs, the forward starts past p_valid and ends the repair at p_full."""
    for p_full in range(0, 400, 4):
        for p_valid in range(0, p_full + 1, 4):
            r = plan_reuse(p_full, p_valid, Geometry(4, 16, 3), repair=True)
            assert r.reused >= p_valid and r.reused + r.repaired in (p_valid, p_full)
