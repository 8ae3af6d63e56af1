"""Unit tests of HybridAllocator and PageAllocator: alloc, free, free_swa, translate, integrity."""

from __future__ import annotations

import pytest
import torch

from worker.kv import HybridAllocator, PageAllocator


def t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def make(full: int = 32, swa: int = 32, page: int = 4, hybrid: bool = True) -> HybridAllocator:
    a = HybridAllocator(full, swa, page, hybrid=hybrid)
    a.check_integrity()
    return a


# ---- PageAllocator ---------------------------------------------------------------------------
def test_page_allocator_never_hands_out_page_0():
    """All pages 1..n come out once, page 0 never; then the list is empty."""
    pa = PageAllocator(5, 4)
    got = pa.alloc(5)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert pa.alloc(1) is None
    pa.check_integrity()


def test_page_allocator_free_validates_before_mutating():
    """A bad page in a batch rejects the whole batch."""
    pa = PageAllocator(4, 1)
    pages = pa.alloc(2)
    before = pa.free_pages()
    for bad in ([pages[0], 0], [pages[0], 9], [pages[0], pages[0]], [pages[0], 3]):
        with pytest.raises(ValueError):
            pa.free(bad)
        assert pa.free_pages() == before
    pa.check_integrity()


# ---- alloc -----------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 2, 4, 16])
def test_alloc_same_offsets_in_both_pools(page: int):
    """Token i sits at in-page offset i % P in both pools; slot 0 / page 0 never used."""
    a = make(16 * page, 8 * page, page)
    n = 3 * page + 1 if page > 1 else 5
    full = a.alloc(n)
    swa = a.translate(full)
    assert full.numel() == n and torch.unique(full).numel() == n
    assert bool((full >= page).all()) and bool((swa >= page).all())
    assert torch.equal(full % page, torch.arange(n) % page)
    assert torch.equal(swa % page, full % page)
    used_pages = -(-n // page)
    assert a.full_available_size() == (16 - used_pages) * page
    assert a.swa_available_size() == (8 - used_pages) * page
    a.check_integrity()


def test_alloc_refused_changes_nothing():
    """Either pool short -> None and identical free lists and mapping."""
    a = make(32, 8, 4)
    a.alloc(4)
    before = a.snapshot()
    assert a.alloc(5) is None  # needs 2 pages, SWA has 1
    assert a.snapshot() == before
    assert a.alloc(4) is not None
    a.check_integrity()


def test_alloc_zero_tokens():
    """alloc(0) is an empty allocation, not a refusal."""
    a = make()
    out = a.alloc(0)
    assert out is not None and out.numel() == 0
    assert a.available_size() == 32


# ---- alloc_extend / alloc_decode -------------------------------------------------------------
def test_alloc_extend_continues_partial_page():
    """The first tokens fill the partial page after last_loc, in both pools."""
    a = make(32, 32, 4)
    first = a.alloc(6)  # pages A (4 tokens) and B (2 tokens)
    out = a.alloc_extend([6], [11], [int(first[-1])])
    assert out.tolist()[:2] == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert torch.equal(a.translate(out[:2]), a.translate(first[-1:]) + t([1, 2]))
    assert torch.equal(out % 4, torch.arange(6, 11) % 4)
    assert a.full_available_size() == 32 - 12
    a.check_integrity()


def test_alloc_extend_no_prefix_uses_minus_one_last_loc():
    """last_loc -1 with prefix 0 gives fresh pages for every request."""
    a = make(64, 64, 4)
    out = a.alloc_extend([0, 0], [5, 3], [-1, -1])
    assert out.numel() == 8
    assert a.full_available_size() == 64 - 12  # 2 pages + 1 page
    a.check_integrity()


@pytest.mark.parametrize("page", [1, 4])
def test_alloc_decode_new_page_iff_position_starts_a_page(page: int):
    """A decode takes a page only when (seq_len - 1) % P == 0."""
    a = make(16 * page, 16 * page, page)
    table = a.alloc(1).tolist()
    for seq in range(2, 3 * page + 2):
        free_before = a.full_available_size()
        out = a.alloc_decode([seq], [table[-1]])
        took = free_before - a.full_available_size()
        assert took == (page if (seq - 1) % page == 0 else 0)
        table += out.tolist()
    assert torch.equal(torch.tensor(table) % page, torch.arange(len(table)) % page)
    a.check_integrity()


def test_alloc_extend_rejects_bad_last_loc_without_change():
    """Wrong offset or a free page as last_loc raises ValueError and changes nothing."""
    a = make(32, 32, 4)
    first = a.alloc(6)
    before = a.snapshot()
    with pytest.raises(ValueError, match="offset"):
        a.alloc_extend([6], [8], [int(first[0])])
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_extend([6], [8], [-1])
    with pytest.raises(ValueError, match="one entry per request"):
        a.alloc_extend([6], [8, 9], [int(first[-1])])
    assert a.snapshot() == before


def test_alloc_extend_into_swa_freed_partial_page_raises():
    """Continuing a page whose SWA was freed would write into page 0: refuse atomically."""
    a = make(32, 32, 4)
    first = a.alloc(6)
    a.free_swa(first[-1:])
    before = a.snapshot()
    with pytest.raises(RuntimeError, match="no SWA page"):
        a.alloc_extend([6, 0], [7, 4], [int(first[-1]), -1])
    assert a.snapshot() == before


# ---- free / free_swa -------------------------------------------------------------------------
def test_free_returns_both_pools_and_unmaps():
    """free gives back full and SWA pages and zeroes the mapping."""
    a = make()
    x = a.alloc(7)
    a.free(x)
    assert a.full_available_size() == 32 and a.swa_available_size() == 32
    assert bool((a.mapping[:-1] == 0).all())
    a.check_integrity()


def test_free_twice_is_a_double_free():
    """The second free raises and leaves the state as after the first."""
    a = make()
    x = a.alloc(5)
    a.free(x)
    before = a.snapshot()
    with pytest.raises(ValueError, match="double free"):
        a.free(x)
    assert a.snapshot() == before


def test_free_skips_non_slots_but_refuses_page_0():
    """-1 and 0 are 'no slot' and skipped; a slot of page 0 is an error."""
    a = make()
    x = a.alloc(4)
    a.free(torch.cat([t([-1, 0]), x]))
    assert a.full_available_size() == 32
    assert int(a.mapping[-1]) == -1
    with pytest.raises(ValueError, match="page 0"):
        a.free(t([1]))
    with pytest.raises(ValueError, match="outside"):
        a.free(t([32 + 4]))
    a.check_integrity()


def test_free_swa_is_idempotent_and_keeps_full():
    """free_swa twice frees once; the full pages stay allocated."""
    a = make()
    x = a.alloc(8)
    a.free_swa(x)
    assert a.swa_available_size() == 32 and a.full_available_size() == 24
    snap = a.snapshot()
    a.free_swa(x)
    assert a.snapshot() == snap
    a.free(x)  # full freed; SWA part is a no-op thanks to the zeroed mapping
    assert a.full_available_size() == 32
    a.check_integrity()


def test_free_swa_of_minus_one_keeps_sentinel():
    """-1 never reaches the mapping's tail."""
    a = make()
    a.alloc(4)
    a.free_swa(t([-1, -1]))
    assert int(a.mapping[-1]) == -1 and a.swa_available_size() == 28


def test_empty_free_is_noop():
    """Empty tensors free nothing."""
    a = make()
    a.alloc(4)
    snap = a.snapshot()
    a.free(t([]))
    a.free_swa(t([]))
    assert a.snapshot() == snap


# ---- translate / set_mapping -----------------------------------------------------------------
def test_translate_sentinel_and_unmapped():
    """-1 -> -1, unmapped -> 0, mapped -> its SWA slot."""
    a = make()
    x = a.alloc(4)
    swa = a.translate(x)
    assert a.translate(t([-1])).tolist() == [-1]
    assert a.translate(t([0])).tolist() == [0]
    a.free_swa(x)
    assert a.translate(x).tolist() == [0, 0, 0, 0]
    assert bool((swa > 0).all())


def test_set_mapping_moves_swa_to_another_full_page():
    """Adopting an SWA page: point the old full page at it, unmap the new one, free new full."""
    a = make()
    node, req = a.alloc(4), a.alloc(4)
    a.free_swa(node)  # tombstone
    swa = a.translate(req)
    a.set_mapping(node, swa)
    a.set_mapping(req, torch.zeros(4, dtype=torch.int64))
    swa_free = a.swa_available_size()
    a.free(req)
    assert a.swa_available_size() == swa_free
    assert torch.equal(a.translate(node), swa)
    a.check_integrity()


def test_set_mapping_validates():
    """Offsets must match and both pages must be allocated."""
    a = make()
    x, y = a.alloc(4), a.alloc(4)
    with pytest.raises(ValueError, match="offset"):
        a.set_mapping(x[:1], a.translate(y[1:2]))
    with pytest.raises(ValueError, match="free page"):
        a.set_mapping(t([28]), t([4]))
    with pytest.raises(ValueError, match="twice"):
        a.set_mapping(t([int(x[0]), int(x[0])]), t([0, 0]))


# ---- hybrid=False ----------------------------------------------------------------------------
def test_non_hybrid_is_one_pool():
    """translate is identity, free_swa a no-op, SWA sizes report the full pool's."""
    a = make(32, 999, 4, hybrid=False)
    assert a.swa_size == 32
    x = a.alloc(6)
    assert torch.equal(a.translate(x), x)
    assert a.translate(t([-1])).tolist() == [-1]
    a.free_swa(x)
    assert a.swa_available_size() == a.full_available_size() == 24
    a.check_integrity()
    a.free(x)
    assert a.available_size() == 32
    a.check_integrity()


# ---- check_integrity detects corruption ------------------------------------------------------
def swap(a: HybridAllocator, i: int, j: int) -> None:
    a.mapping[[i, j]] = a.mapping[[j, i]].clone()


CORRUPTIONS = {
    "sentinel": lambda a, x, y: a.mapping.__setitem__(-1, 0),
    "two full slots": lambda a, x, y: a.mapping.__setitem__(int(x[1]), int(a.mapping[x[0]])),
    "free page but is still mapped": lambda a, x, y: a.mapping.__setitem__(28, 0 + 31),
    "offsets": lambda a, x, y: swap(a, int(x[0]), int(x[1])),
    "page 0 is mapped": lambda a, x, y: a.mapping.__setitem__(1, 0 + 30),
    "leak": lambda a, x, y: a.mapping.__setitem__(y, 0),
    "twice in the free list": lambda a, x, y: a.swa._free.append(a.swa._free[0]),
    "page 0 is in the free list": lambda a, x, y: a.full._free.append(0),
    "pairs with two pages": lambda a, x, y: swap(a, int(x[0]), int(y[0])),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_integrity_catches_corruption(name: str):
    """Each corruption of the bookkeeping is reported by name."""
    a = make()
    x, y = a.alloc(4), a.alloc(4)
    a.alloc(4)
    CORRUPTIONS[name](a, x, y)
    with pytest.raises(AssertionError, match=name):
        a.check_integrity()


def test_clear_resets_everything():
    """clear frees both pools and unmaps, sentinel intact."""
    a = make()
    a.alloc(9)
    a.clear()
    assert a.available_size() == 32
    assert int(a.mapping[-1]) == -1 and bool((a.mapping[:-1] == 0).all())
    a.check_integrity()


# ---- bad configs -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("full", "swa", "page", "match"),
    [
        (30, 32, 4, "not a multiple of page_size"),
        (32, 30, 4, "swa_size=30 is not a multiple"),
        (32, 32, 3, "power of two"),
        (32, 32, 0, "power of two"),
        (32, 0, 4, "swa_size=0 tokens holds no page"),
        (2, 32, 4, "full_size=2 tokens holds no page"),
    ],
)
def test_bad_config_messages(full: int, swa: int, page: int, match: str):
    """Sizes and page size are validated with messages that say what to change."""
    with pytest.raises(ValueError, match=match):
        HybridAllocator(full, swa, page)


@pytest.mark.parametrize("hybrid", [True, False])
def test_vectorised_alloc_decode_equals_alloc_extend(hybrid: bool):
    """alloc_decode over a batch (one tensor pass) hands out exactly the slots, pages, mapping and
    free lists that alloc_extend of one token per request does, step after step, across page
    boundaries; a refused batch changes nothing on either."""
    import random

    rng = random.Random(7)
    P = 4
    a = HybridAllocator(512, 256, P, hybrid=hybrid)
    b = HybridAllocator(512, 256, P, hybrid=hybrid)
    lens = [rng.randint(1, 9) for _ in range(12)]
    tables = []
    for n in lens:
        sa, sb = a.alloc(n), b.alloc(n)
        assert sa is not None and sb is not None and torch.equal(sa, sb)
        tables.append(sa.tolist())
    for _ in range(30):
        seq = [len(t) + 1 for t in tables]
        last = [t[-1] for t in tables]
        got = a.alloc_decode(seq, last)
        want = b.alloc_extend([s - 1 for s in seq], seq, last)
        assert (got is None) == (want is None)
        assert a.snapshot() == b.snapshot()
        if got is None:
            break
        assert torch.equal(got, want)
        for t, slot in zip(tables, got.tolist()):
            t.append(slot)
    a.check_integrity()


def test_vectorised_alloc_decode_rejects_bad_last_loc_without_change():
    a = HybridAllocator(64, 64, 4)
    s = a.alloc(6)
    assert s is not None
    before = a.snapshot()
    with pytest.raises(ValueError, match="last_loc"):
        a.alloc_decode([7, 7], [int(s[5]), int(s[4])])  # the second is at the wrong offset
    with pytest.raises(ValueError, match="seq_lens include the new token"):
        a.alloc_decode([0], [-1])
    a.free_swa(s[4:6])  # the partial page lost its SWA page
    with pytest.raises(RuntimeError, match="no SWA page"):
        a.alloc_decode([7], [int(s[5])])
    assert a.snapshot().full_free == before.full_free
