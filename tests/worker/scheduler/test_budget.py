"""Admission math (docs/design.md §11.3): the SWA budget table, chunk caps, continuing chunks."""

from __future__ import annotations

import pytest

from core.geometry import Geometry, ceil_page, floor_page
from worker.kv.frontier import steady_swa_per_request
from worker.scheduler.budget import (
    chunk_cap,
    continuing_chunk_len,
    full_admission_charge,
    full_admits,
    swa_admission_charge,
)


@pytest.mark.parametrize(
    ("extend", "chunk", "window", "page", "charge"),
    [
        (64, None, 128, 16, 144),
        (200, None, 256, 32, 288),
        (300, None, 128, 16, 316),
        (200, 50, 64, 8, 72),
        (300, 500, 64, 64, 364),
        (0, None, 128, 16, 144),
    ],
)
def test_swa_charge_table(
    extend: int, chunk: int | None, window: int, page: int, charge: int
) -> None:
    """SWA charge = max(min(e, c), W) + P, SGLang's budget table."""
    assert swa_admission_charge(extend, chunk, Geometry(page, window)) == charge


def test_full_charge_rounds_the_extend_to_pages() -> None:
    """Full charge = ceil_P(e) + max_new + P; with max_new 0 it is what the request holds now."""
    assert full_admission_charge(100, 50, 16) == 112 + 50 + 16
    assert full_admission_charge(96, 0, 16) == 96 + 16
    assert full_admits(100, 50, 16, rem_total=167) and not full_admits(100, 50, 16, rem_total=166)


def test_chunk_cap_is_the_swa_room_above_window_and_a_page() -> None:
    """chunk_cap = floor_P(rem_swa - W - P); <= 0 when the pool cannot take a chunk."""
    assert chunk_cap(rem_swa=1000, g=Geometry(page_size=16, window=128)) == 848
    assert chunk_cap(rem_swa=1001, g=Geometry(page_size=16, window=127)) == 848
    assert chunk_cap(rem_swa=140, g=Geometry(page_size=16, window=128)) <= 0


def test_continuing_chunk_shrinks_to_the_swa_room_or_defers() -> None:
    """P=64: rem_swa 100 -> chunk 36; rem_swa 64 -> 0, i.e. deferred (not scheduled)."""
    assert continuing_chunk_len(rem_chunk=512, remaining=10_000, rem_swa=100, page_size=64) == 36
    assert continuing_chunk_len(rem_chunk=512, remaining=10_000, rem_swa=64, page_size=64) <= 0


def test_continuing_chunk_without_swa_pool_is_unaffected() -> None:
    """Non-hybrid (rem_swa None): min(rem_chunk, remaining) only."""
    assert continuing_chunk_len(rem_chunk=512, remaining=300, rem_swa=None, page_size=64) == 300
    assert continuing_chunk_len(rem_chunk=200, remaining=300, rem_swa=None, page_size=64) == 200


def test_steady_hold_and_page_rounding() -> None:
    """A decoding request holds W + interval + P SWA tokens at most; page helpers round right."""
    assert steady_swa_per_request(window=127, interval=128, page_size=16) == 271
    assert steady_swa_per_request(window=8, interval=0, page_size=4) == 13  # interval floors at 1
    assert (floor_page(37, 16), ceil_page(37, 16), ceil_page(32, 16), floor_page(-5, 4)) == (
        32,
        48,
        32,
        -8,
    )
