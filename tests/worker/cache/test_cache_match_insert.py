"""Match and insert (docs/design.md §9.2, §9.3), events and the window rule's edge cases."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import make_cache, node_at, put

from core.events import EventKind, page_hashes
from worker.cache.base import EvictResult

SWA_CONFIGS = [(1, 4), (4, 4), (4, 2), (16, 16), (64, 64), (128, 128), (128, 4), (1, 128)]


def roomy(page: int, window: int):
    size = 16 * page * max(4, -(-window // page) + 2)
    return make_cache(page, window, size, size)


def seq(start: int, pages: int, page_size: int) -> list[int]:
    return list(range(start, start + pages * page_size))


def test_kv_events_store_tombstone_remove() -> None:
    """Stores name new pages only; SWA eviction removes nothing; full removes all."""
    cache = make_cache(1, 4, 64, 32)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 3, 4, 5, 6])
    ev = cache.drain_events()
    stored = [h for e in ev if e.kind is EventKind.STORED for h in e.page_hashes]
    assert stored == page_hashes([1, 2, 3, 4, 5, 6], 1)
    assert [len(e.page_hashes) for e in ev] == [4, 2]
    res = cache.evict(0, 1)
    assert res.full == 0 and res.swa >= 1
    assert all(e.kind is not EventKind.REMOVED for e in cache.drain_events())
    res = cache.evict(1, 0)
    assert res.full >= 1
    removed = {
        h for e in cache.drain_events() if e.kind is EventKind.REMOVED for h in e.page_hashes
    }
    assert removed == set(stored)
    cache.check_integrity()


def test_kv_events_split_chains_from_the_shared_page() -> None:
    """A branch's first new page is chained from the shared page's hash."""
    cache = make_cache(1, 4, 64, 32)
    put(cache, [1, 2, 3, 4])
    cache.drain_events()
    put(cache, [1, 2, 5, 6])
    (ev,) = cache.drain_events()
    assert ev.kind is EventKind.STORED and len(ev.page_hashes) == 2
    parent = page_hashes([1, 2, 3, 4], 1)[1]
    assert ev.page_hashes == tuple(page_hashes([5, 6], 1, parent))
    cache.check_integrity()


def test_radix_cache_scenario_with_tombstoned_internal_node() -> None:
    """On our LRU policy: LRU leaf first, then an SWA-evicted internal node makes
    the short branch unmatchable while the long branch stays valid."""
    cache = make_cache(1, 4, 128, 64)
    assert put(cache, [1, 2, 3])[0].prefix_len == 0
    assert put(cache, [1, 2, 3, 4, 5, 6, 7])[0].prefix_len == 3
    assert put(cache, [10, 11, 12])[0].prefix_len == 0
    assert put(cache, [1, 2, 3, 4, 5, 60, 70])[0].prefix_len == 5
    cache.check_integrity()
    # NOTE: the split of [4,5,6,7] is no access of [6,7] (legacy refreshed it), so the
    # least recently used leaf is [6,7], not [10,11,12].
    assert cache.evict(1, 0) == EvictResult(2, 2)
    assert list(node_at(cache, [1, 2, 3, 4, 5]).children) == [(60,)]  # [6,7] is gone
    # SWA order, oldest first: [10,11,12], [1,2,3], [4,5], [60,70] (the last insert refreshed
    # only the nodes within window + page tokens above [60,70], and the split put [4,5] there).
    assert cache.evict(0, 1) == EvictResult(3, 3)  # the unlocked leaf [10,11,12] goes whole
    assert cache.evict(0, 1) == EvictResult(0, 3)  # internal [1,2,3] is tombstoned in place
    assert node_at(cache, [1, 2, 3]).is_tombstone
    cache.check_integrity()
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 0
    m = cache.match_prefix([1, 2, 3, 4, 5, 60, 70])
    assert m.length == 7 and m.node.key == (60, 70) and len(m.indices) == 7
    assert torch.equal(m.indices[:3], node_at(cache, [1, 2, 3]).full)  # tombstoned span included
    cache.check_integrity()


def test_match_resets_run_at_every_tombstone() -> None:
    """T1 → 2 live → T2 → 3 live with W=4 must match nothing (runs never add up)."""
    cache = make_cache(1, 4, 64, 64)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # nodes capped: [1..6] + [7..10]
    cache.tree.split(node_at(cache, [1, 2, 3, 4, 5, 6]), 2)  # [1,2] [3,4,5,6]
    cache.tree.split(node_at(cache, [1, 2, 3, 4, 5, 6]), 2)  # [3,4] [5,6]
    cache.tree.split(node_at(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 1)  # [7] [8,9,10]
    for toks in ([1, 2], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]):  # T1=[1,2], T2=[5,6][7]
        node = node_at(cache, toks)
        cache.tree.tombstone(node)
        cache.allocator.free_swa(node.full)
    cache.check_integrity()
    assert cache.match_prefix(list(range(1, 11))).length == 0
    assert cache.match_prefix([1, 2, 3, 4]).length == 0  # 2 live after T1
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], prev=10)  # 5 live after T2
    assert cache.match_prefix(list(range(1, 13))).length == 12


@pytest.mark.parametrize(
    "window,page,leaf,tail",
    [(4, 1, 12, 4), (4, 1, 5, 4), (1, 1, 5, 1), (4, 2, 12, 4), (8, 2, 12, 8), (4, 4, 12, 4),
     (3, 2, 12, 4), (5, 4, 12, 8), (3, 4, 12, 4), (4, 1, 4, 4), (4, 1, 3, 3), (4, 2, 4, 4),
     (3, 2, 4, 4), (8, 2, 4, 4), (4, 4, 4, 4)],
)  # fmt: skip
def test_new_leaf_capped_to_one_window(window: int, page: int, leaf: int, tail: int) -> None:
    """A new live leaf keeps only ceil_P(window) tokens; the lock covers them."""
    cache = make_cache(page, window, 128, 64)
    toks = list(range(100, 100 + leaf))
    put(cache, toks)
    m = cache.match_prefix(toks)
    assert m.length == leaf and len(m.node) == tail
    assert (m.node.parent is cache.tree.root) == (leaf == tail)
    receipt = cache.lock(m.node)
    assert cache.swa_protected == tail and cache.full_protected == leaf
    cache.unlock(receipt)
    assert cache.swa_protected == 0 and cache.full_protected == 0
    cache.check_integrity()


@pytest.mark.parametrize("page,window", SWA_CONFIGS)
def test_cap_on_reference_configs(page: int, window: int) -> None:
    """The cap on every SWA config: tail + 2 pages splits, exactly tail does not."""
    tail = -(-window // page) * page
    cache = roomy(page, window)
    put(cache, seq(1, tail // page + 2, page))
    m = cache.match_prefix(seq(1, tail // page + 2, page))
    assert len(m.node) == tail and not m.node.parent.is_root
    put(cache, seq(10_000, tail // page, page))
    assert node_at(cache, seq(10_000, tail // page, page)).parent.is_root
    cache.check_integrity()


@pytest.mark.parametrize("page,window", SWA_CONFIGS)
def test_generic_insert_and_match(page: int, window: int) -> None:
    """Prefix lengths, divergent and unrelated matches, shared-prefix split."""
    cache = roomy(page, window)
    a, b = seq(1, 2, page), seq(1, 3, page)
    assert put(cache, a)[0].prefix_len == 0
    assert put(cache, b)[0].prefix_len == len(a)
    assert cache.match_prefix(b).length == len(b)
    divergent = a + [99_999] * page
    assert cache.match_prefix(divergent).length == len(a)
    assert cache.match_prefix([77_777] * page).length == 0
    assert cache.match_prefix(b[: page - 1] if page > 1 else []).length == 0  # < one page
    cache.check_integrity()


@pytest.mark.parametrize("page,window", [(1, 4), (4, 4), (4, 2), (16, 16)])
def test_prev_prefix_len_frees_only_duplicates(page: int, window: int) -> None:
    """Duplicates beyond prev_prefix_len are freed, the shared part never."""
    cache = roomy(page, window)
    a = cache.allocator
    put(cache, seq(1, 1, page))
    free0 = a.full_available_size()
    put(cache, seq(1, 2, page))  # prev 0: its first page duplicates the tree's
    assert a.full_available_size() == free0 - page
    free1 = a.full_available_size()
    put(cache, seq(1, 3, page), prev=2 * page)  # shares 2 pages: nothing freed, 1 page taken
    assert a.full_available_size() == free1 - page
    cache.check_integrity()


@pytest.mark.parametrize("page,window", SWA_CONFIGS)
def test_leaf_kept_when_whole_span_is_out_of_window(page: int, window: int) -> None:
    """Whole span out of window, chosen behaviour — a FULL-only leaf, nothing freed."""
    cache = roomy(page, window)
    a = cache.allocator
    toks = seq(1, 2, page)
    free_before = a.full_available_size() - len(toks)
    _, values = put(cache, toks, evicted=len(toks))
    assert a.full_available_size() == free_before
    node = node_at(cache, toks)
    assert torch.equal(node.full, values) and node.swa is None and node.parent.is_root
    assert cache.swa_evictable == 0 and cache.full_evictable == len(toks)
    assert cache.match_prefix(toks).length == 0
    (ev,) = cache.drain_events()
    assert ev.kind is EventKind.STORED_FULL_ONLY
    cache.check_integrity()


def test_insert_with_frontier_makes_tombstone_prefix() -> None:
    """Insert with a frontier: [0, evicted) becomes a tombstone, the rest a live leaf."""
    cache = make_cache(1, 4, 64, 64)
    put(cache, list(range(1, 9)), evicted=4)
    (top,) = cache.tree.root.children.values()
    (leaf,) = top.children.values()
    assert len(top) == 4 and top.is_tombstone and len(leaf) == 4 and not leaf.is_tombstone
    assert cache.match_prefix(list(range(1, 9))).length == 8
    assert cache.match_prefix(list(range(1, 8))).length == 0
    cache.check_integrity()


def test_revive_tombstone_split_where_frontier_falls_inside() -> None:
    """Revival split: the part below the frontier stays a tombstone, the rest is revived
    with the request's slots (unlocked: the node's old full slots are freed)."""
    cache = make_cache(1, 4, 64, 64)
    toks = list(range(1, 9))
    put(cache, toks, evicted=8)  # one FULL-only leaf of 8
    old = node_at(cache, toks).full.clone()
    a = cache.allocator
    full0, swa0 = a.full_available_size(), a.swa_available_size()
    _, values = put(cache, toks, evicted=3)
    upper, lower = node_at(cache, toks[:3]), node_at(cache, toks)
    assert upper.is_tombstone and torch.equal(upper.full, old[:3])
    assert not lower.is_tombstone and torch.equal(lower.full, values[3:])
    # request: 8 full + 8 SWA allocated, 3 SWA freed, 3 dup full freed; node: 5 old full freed
    assert a.full_available_size() == full0 - 8 + 3 + 5
    assert a.swa_available_size() == swa0 - 8 + 3
    kinds = [e.kind for e in cache.drain_events()]
    assert kinds == [EventKind.STORED_FULL_ONLY, EventKind.SWA_RESTORED]
    assert cache.match_prefix(toks).length == 8
    cache.check_integrity()
