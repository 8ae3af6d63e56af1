"""The out-of-window frontier (docs/design.md §7): worked values, boundaries, a matrix."""

from __future__ import annotations

import itertools

import pytest
import torch

from core.geometry import Geometry, floor_page
from worker.kv import HybridAllocator, free_out_of_window, swa_frontier
from worker.kv.frontier import frontier_start, gather_spans, live_spans_to_free


def radix(pre_len: int, window: int, page: int, evicted: int = 0, protected: int = 0) -> int:
    return swa_frontier(
        Geometry(page, window),
        evicted=evicted,
        protected=protected,
        pre_len=pre_len,
        chunk_cache=False,
    )


def chunk(pre_len: int, window: int, page: int, evicted: int = 0, protected: int = 0) -> int:
    return swa_frontier(
        Geometry(page, window),
        evicted=evicted,
        protected=protected,
        pre_len=pre_len,
        chunk_cache=True,
    )


def assert_radix_frontier_ok(seq_len: int, window: int, page: int, frontier: int) -> None:
    """Insert boundary floor_P(seq_len) stays above the frontier with >= W live tokens below it,
    and the query at seq_len - 1 keeps its window."""
    boundary = floor_page(seq_len, page)
    assert frontier % page == 0
    assert frontier <= max(0, seq_len - 1 - window)
    if frontier:
        assert frontier < boundary, (seq_len, window, page, frontier)
        assert boundary - frontier >= window, (seq_len, window, page, frontier)


# ---- worked examples and boundary cases ------------------------------------------------------
@pytest.mark.parametrize(
    ("page", "window", "pre_len", "expected"),
    [(1, 4, 19, 15), (8, 2, 24, 16), (8, 4, 9, 0), (64, 127, 1023, 896)],
)
def test_worked_examples(page: int, window: int, pre_len: int, expected: int):
    """Worked examples of the radix formula pre_len - max(W, P), page-floored."""
    assert radix(pre_len, window, page) == expected


def test_page_larger_than_window_sweep():
    """P > W, seq_len in (P, 5P), pre_len = seq_len - 1 -> frontier < floor_P(seq_len)."""
    for page, window in itertools.product((4, 8, 16, 32, 64, 128, 256), (1, 2, 4, 8)):
        if page <= window:
            continue
        for seq_len in range(page + 1, 5 * page):
            f = radix(seq_len - 1, window, page)
            assert f < floor_page(seq_len, page), (page, window, seq_len, f)


@pytest.mark.parametrize(("seq_len", "expected"), [(13, 4), (17, 8), (25, 16), (33, 24)])
def test_page_not_above_window(seq_len: int, expected: int):
    """P=4, W=8."""
    f = radix(seq_len - 1, 8, 4)
    assert f == expected
    assert_radix_frontier_ok(seq_len, 8, 4, f)


def test_token_granular_frontier_is_seq_minus_window_minus_one():
    """P=1, W=4 -> frontier == max(0, seq_len - 5)."""
    for seq_len in range(6, 31):
        assert radix(seq_len - 1, 4, 1) == max(0, seq_len - 5)


def test_short_sequence_is_a_noop():
    """P=8, W=4, seq 10 -> frontier stays 0."""
    assert radix(9, 4, 8) == 0


def test_insert_cases_page_8_window_2():
    """The frontier halves of the insert cases: P=8, W=2."""
    assert radix(15, 2, 8) == 0  # 12: 24-token request evicted at pre_len 15
    assert radix(24, 2, 8) == 16  # 13: seq 25 -> tombstone [0,16) + live [16,24)
    # 14: the old formula pre_len - W reaches the insert boundary 8 of an 11-token request;
    # the radix margin keeps it at 0 (the chunk cache has no tree, so it may go to 8).
    assert radix(10, 2, 8) == 0 and chunk(10, 2, 8) == 8
    evicted = 0
    for turn in range(4):  # 15: growing multi-turn decode
        seq_len = 8 * (turn + 2) + 1
        new = radix(seq_len - 1, 2, 8, evicted=evicted)
        assert evicted <= new < floor_page(seq_len, 8)
        evicted = new


def test_eager_chunked_prefill_values():
    """Eager freeing (frontier part): P=1, W=4, 20 committed -> 15; 5 committed -> 0."""
    assert radix(19, 4, 1) == 15
    assert radix(4, 4, 1) == 0


# ---- (P, W) matrix ---------------------------------------------------------------------------
def boundary_lengths(page: int, window: int) -> set[int]:
    around = {k * page + d for k in range(1, 6) for d in (-2, -1, 0, 1, 2)}
    around |= {k * window + d for k in range(1, 4) for d in (-2, -1, 0, 1, 2)}
    around |= {window + page + d for d in (-2, -1, 0, 1, 2)}
    return {n for n in around if n >= 1}


@pytest.mark.parametrize("page", [1, 4, 8, 64, 128, 256])
@pytest.mark.parametrize("window", [1, 2, 4, 127, 128])
def test_frontier_matrix(page: int, window: int):
    """Every (P, W, seq_len) near a boundary: frontier < insert boundary, >= W live tail,
    page aligned, below the query's window, and monotone along a growing request."""
    evicted = 0
    for seq_len in sorted(boundary_lengths(page, window)):
        f = radix(seq_len - 1, window, page)
        assert_radix_frontier_ok(seq_len, window, page, f)
        evicted = radix(seq_len - 1, window, page, evicted=evicted)
        assert evicted >= f and evicted % page == 0
        c = chunk(seq_len - 1, window, page)
        assert c % page == 0 and c <= max(0, seq_len - 1 - window)


def test_cap_only_binds_where_the_plain_margin_breaks_the_window_rule():
    """The cap at floor_P(pre_len+1) - ceil_P(W) changes the SGLang value only when that value
    would leave fewer than W live tokens below the insert boundary."""
    for page, window in itertools.product((1, 2, 4, 8, 16), range(0, 40)):
        for seq_len in range(1, 6 * page + 2 * window + 4):
            ours = radix(seq_len - 1, window, page)
            plain = max(0, floor_page(seq_len - 1 - max(window, page), page))
            assert_radix_frontier_ok(seq_len, window, page, ours)
            if ours != plain:
                assert ours < plain
                assert floor_page(seq_len, page) - plain < window
                assert window > page and window % page not in (0, page - 1)
    # the NOTE's example
    assert radix(10, 5, 4) == 0


# ---- floor, protected, validation ------------------------------------------------------------
def test_never_below_protected_and_monotone():
    """The tree-owned prefix bounds the frontier from below; it never moves back."""
    assert radix(10, 4, 1, protected=8) == 8
    assert radix(20, 4, 4, evicted=32) == 32
    assert radix(20, 4, 4, evicted=8, protected=24) == 24
    assert radix(40, 4, 4, evicted=8, protected=16) == 36


def test_floor_is_rounded_up_to_a_page():
    """A pinned floor inside a page pins the whole page."""
    assert frontier_start(Geometry(4, None), evicted=0, protected=0, floor=3) == 4
    assert frontier_start(Geometry(4, None), evicted=0, protected=8, floor=3) == 8
    assert (
        swa_frontier(Geometry(4, 1), evicted=0, protected=0, pre_len=5, chunk_cache=True, floor=3)
        == 4
    )


def test_unaligned_inputs_raise():
    """protected and evicted are page aligned by construction; anything else is a bug."""
    with pytest.raises(ValueError, match="protected"):
        radix(40, 4, 4, protected=6)
    with pytest.raises(ValueError, match="evicted"):
        radix(40, 4, 4, evicted=5)
    with pytest.raises(ValueError, match="window"):
        radix(40, -1, 4)


# ---- free_out_of_window ----------------------------------------------------------------------
@pytest.mark.parametrize(("page", "window"), [(1, 4), (4, 3), (4, 8), (16, 1)])
def test_free_out_of_window_frees_exactly_the_span(page: int, window: int):
    """SWA pages of [start, new) are freed and unmapped; the rest stays mapped."""
    a = HybridAllocator(64 * page, 64 * page, page)
    table = a.alloc(10 * page + 3)
    protected = 2 * page
    evicted = 0
    for pre_len in range(1, table.numel() + 1):
        swa_free = a.swa_available_size()
        start = max(evicted, protected)
        new = free_out_of_window(
            a,
            table,
            Geometry(page, window),
            evicted=evicted,
            protected=protected,
            pre_len=pre_len,
            chunk_cache=False,
        )
        assert new >= evicted
        assert a.swa_available_size() - swa_free == max(0, new - start)
        assert bool((a.translate(table[protected:new]) == 0).all())
        assert bool((a.translate(table[:protected]) > 0).all())  # tree-owned, untouched
        assert bool((a.translate(table[max(new, protected) :]) > 0).all())
        evicted = new
        a.check_integrity()
    again = a.snapshot()
    free_out_of_window(
        a,
        table,
        Geometry(page, window),
        evicted=evicted,
        protected=protected,
        pre_len=table.numel(),
        chunk_cache=False,
    )
    assert a.snapshot() == again


def test_free_out_of_window_checks_page_size_and_table():
    """A mismatched page size or a table shorter than the frontier raises."""
    a = HybridAllocator(64, 64, 4)
    table = a.alloc(8)
    kw = dict(evicted=0, protected=0, chunk_cache=True)
    with pytest.raises(ValueError, match="page_size"):
        free_out_of_window(a, table, Geometry(8, 1), pre_len=20, **kw)
    with pytest.raises(ValueError, match="past the request's table"):
        free_out_of_window(a, table, Geometry(4, 1), pre_len=20, **kw)


# ---- finishing without a mapping -------------------------------------------------------------
def test_live_spans_skip_the_evicted_hole():
    """Row 0..9, floor 3, evicted 6, kv_len 8 -> [0,1,2,6,7]; protected 2 -> [2,6,7]."""
    row = torch.arange(10)
    spans = live_spans_to_free(protected=0, floor=3, evicted=6, kv_len=8)
    assert gather_spans(row, spans).tolist() == [0, 1, 2, 6, 7]
    spans = live_spans_to_free(protected=2, floor=3, evicted=6, kv_len=8)
    assert gather_spans(row, spans).tolist() == [2, 6, 7]


def test_live_spans_edge_cases():
    """No eviction -> [p, L); evicted past kv_len -> only the pinned part; nothing -> []."""
    assert live_spans_to_free(protected=2, floor=0, evicted=0, kv_len=8) == [(2, 8)]
    assert live_spans_to_free(protected=0, floor=3, evicted=10, kv_len=8) == [(0, 3)]
    assert live_spans_to_free(protected=8, floor=0, evicted=0, kv_len=8) == []
    assert live_spans_to_free(protected=4, floor=0, evicted=6, kv_len=9) == [(6, 9)]
    assert gather_spans(torch.arange(4), []).numel() == 0
