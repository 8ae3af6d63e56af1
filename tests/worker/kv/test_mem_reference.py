"""Allocator scenarios from SGLang's hybrid SWA history (docs/design.md §6.2, §15)."""

from __future__ import annotations

import pytest
import torch

from worker.kv import HybridAllocator


def pages_of(a: HybridAllocator, table: torch.Tensor) -> set[int]:
    return set((table // a.page_size).tolist())


# ---- page-granular free_swa ------------------------------------------------------------------
def test_paged_free_swa_of_one_token_frees_and_unmaps_the_page():
    """P=4, Kf=Ks=16: free_swa(first token) frees the whole SWA page and unmaps all 4
    full slots; free_swa(second token) frees nothing more."""
    a = HybridAllocator(16, 16, 4)
    x = a.alloc(4)
    assert a.swa_available_size() == 12
    a.free_swa(x[:1])
    assert a.swa_available_size() == 16
    assert a.translate(x).tolist() == [0, 0, 0, 0]
    a.free_swa(x[1:2])
    assert a.swa_available_size() == 16
    a.check_integrity()


# ---- alloc_extend page estimation ------------------------------------------------------------
def with_prefixes(page: int, prefix_lens: list[int], full_free: int, swa_free: int):
    """Allocator whose requests hold `prefix_lens` tokens and whose pools then have exactly
    `full_free` / `swa_free` free pages."""
    used = sum(-(-n // page) for n in prefix_lens)
    a = HybridAllocator((used + full_free) * page, (used + swa_free) * page, page)
    tables = [a.alloc(n) for n in prefix_lens]
    assert a.full.num_free_pages == full_free and a.swa.num_free_pages == swa_free
    return a, [int(t[-1]) for t in tables]


def extend(a: HybridAllocator, prefix: list[int], seq: list[int], last: list[int]):
    before = a.snapshot()
    out = a.alloc_extend(prefix, seq, last)
    if out is None:
        assert a.snapshot() == before  # neither pool was touched
    a.check_integrity()
    return out


def test_extend_within_partial_pages_needs_no_new_page():
    """[5,5] -> [6,6] takes 0 pages: fits even with both pools at 2 free pages."""
    a, last = with_prefixes(8, [5, 5], 2, 2)
    out = extend(a, [5, 5], [6, 6], last)
    assert out.tolist() == [last[0] + 1, last[1] + 1]
    assert a.full.num_free_pages == 2


def test_extend_two_new_pages():
    """[7,7] -> [10,10] takes 2 pages."""
    a, last = with_prefixes(8, [7, 7], 2, 2)
    assert extend(a, [7, 7], [10, 10], last) is not None
    assert a.full.num_free_pages == 0 and a.swa.num_free_pages == 0


@pytest.mark.parametrize(("full_free", "swa_free"), [(1, 16), (16, 1)])
def test_extend_refused_by_either_pool(full_free: int, swa_free: int):
    """5 requests 8 -> 9 need 5 pages: one short pool refuses and nothing changes."""
    a, last = with_prefixes(8, [8] * 5, full_free, swa_free)
    assert extend(a, [8] * 5, [9] * 5, last) is None


def test_extend_exactly_at_capacity():
    """2 requests 8 -> 9 with 2/2 pages free succeed; 3 requests are refused."""
    a, last = with_prefixes(8, [8] * 3, 2, 2)
    assert extend(a, [8] * 3, [9] * 3, last) is None
    assert extend(a, [8] * 2, [9] * 2, last[:2]) is not None


@pytest.mark.parametrize("page", [16, 32, 64, 128])
def test_extend_inside_last_page_for_large_pages(page: int):
    """4 requests (P-2) -> (P-1) with 2 pages free succeed (no unconditional extra page)."""
    a, last = with_prefixes(page, [page - 2] * 4, 2, 2)
    out = extend(a, [page - 2] * 4, [page - 1] * 4, last)
    assert out.tolist() == [n + 1 for n in last]


# ---- bug classes (docs/design.md §15) --------------------------------------------------------
def test_one_page_leak_free_swa_one_token_then_free_page():
    """free_swa of one token, then free of the whole page: SWA gains exactly one page
    in total, no double free, full gains the page."""
    a = HybridAllocator(32, 32, 4)
    x = a.alloc(8)
    swa0, full0 = a.swa_available_size(), a.full_available_size()
    a.free_swa(x[5:6])
    a.free(x[4:8])
    assert a.swa_available_size() - swa0 == 4
    assert a.full_available_size() - full0 == 4
    assert bool((a.translate(x[:4]) > 0).all())
    a.check_integrity()


@pytest.mark.parametrize("page", [1, 4])
def test_recycled_pages_carry_no_stale_mapping(page: int):
    """Every path that hands out a full page leaves its unused slots unmapped, even if a
    stale entry was left on a free page."""
    a = HybridAllocator(8 * page, 8 * page, page)
    x = a.alloc(8 * page)
    a.free(x)
    # simulate a buggy path that left a stale entry on a free full page
    a.mapping[x[-1]] = int(x[0])
    with pytest.raises(AssertionError, match="free page but is still mapped"):
        a.check_integrity()
    paths = [
        lambda: a.alloc(1),
        lambda: a.alloc_extend([0], [1], [-1]),
        lambda: a.alloc_decode([1], [-1]),
    ]
    for alloc in paths:
        a.clear()
        a.alloc(7 * page)
        a.mapping[x[-1]] = int(x[0])  # last page is free and stale again
        out = alloc()
        assert (int(out[0]) // page) == (int(x[-1]) // page)
        page_slots = torch.arange(int(out[0]), int(out[0]) + page)
        assert a.translate(page_slots)[1:].tolist() == [0] * (page - 1)
        a.check_integrity()


def test_tombstone_mapping_is_zeroed_and_revival_frees_only_its_own():
    """Tombstoning zeroes the mapping; reviving (unlocked: free the node's old full
    slots) frees no SWA slot, and other requests keep theirs."""
    a = HybridAllocator(32, 32, 4)
    node, other = a.alloc(8), a.alloc(4)
    other_swa = a.translate(other)
    a.free_swa(node)  # tombstone
    assert bool((a.translate(node) == 0).all())
    swa_before = a.swa_available_size()
    request = a.alloc(8)  # the request's fresh copy of the same tokens
    a.free(node)  # revival adopts the request's slots, frees the old full value
    assert a.swa_available_size() == swa_before - 8  # only the request's new pages are in use
    assert torch.equal(a.translate(other), other_swa)
    assert bool((a.translate(request) > 0).all())
    a.check_integrity()


def test_locked_revival_adopts_swa_by_remapping():
    """A full-locked tombstone adopts the request's SWA through set_mapping; the
    request's full slots are then freed without touching that SWA."""
    a = HybridAllocator(32, 32, 4)
    node = a.alloc(4)
    a.free_swa(node)
    request = a.alloc(4)
    swa = a.translate(request)
    a.set_mapping(node, swa)
    a.set_mapping(request, torch.zeros_like(request))
    full_before, swa_before = a.full_available_size(), a.swa_available_size()
    a.free(request)
    assert a.full_available_size() == full_before + 4
    assert a.swa_available_size() == swa_before
    assert torch.equal(a.translate(node), swa)
    a.check_integrity()


def test_page_zero_never_freed_through_any_path():
    """0 and -1 entries in a free are skipped; page 0 never enters a free list."""
    a = HybridAllocator(16, 16, 4)
    x = a.alloc(4)
    a.free(torch.tensor([0, -1, 0]))
    a.free_swa(torch.tensor([0, -1, 2]))
    assert 0 not in a.full.free_pages() and 0 not in a.swa.free_pages()
    a.free(torch.cat([x, torch.tensor([0, 0])]))
    assert a.available_size() == 16 and int(a.mapping[-1]) == -1
    a.check_integrity()
