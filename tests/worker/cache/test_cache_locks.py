"""Locks, the window boundary and early release (docs/design.md §9.4; with our cap:
a new leaf holds at most one page-aligned window)."""

from __future__ import annotations

import pytest
from cache_helpers import make_cache, node_at, put

from worker.cache.base import EvictResult
from worker.cache.radix_cache import RadixCache

pytestmark = pytest.mark.usefixtures("both_policies")


def locked_leaf_without_swa_lock(cache: RadixCache, toks: list[int]):
    """A live leaf that is FULL-locked but not SWA-locked: lock it while it has a child,
    release the window (an internal node is not freed), then evict the child."""
    put(cache, toks)
    receipt = cache.lock(cache.match_prefix(toks).node)
    put(cache, toks + [999] * cache.page_size, prev=len(toks))
    receipt = cache.release_window_lock(receipt)
    assert cache.evict(cache.page_size, 0).full == cache.page_size
    leaf = node_at(cache, toks)
    assert leaf.is_leaf and leaf.full_lock == 1 and leaf.swa_lock == 0 and not leaf.is_tombstone
    return leaf, receipt


def test_early_release_makes_a_leaf_swa_evictable_without_freeing() -> None:
    """Unified semantics: the leaf's SWA becomes evictable (lazy reclaim), its full KV
    stays locked; SWA eviction then tombstones it in place."""
    cache = make_cache(1, 4, 128, 64)
    toks = list(range(1, 9))  # capped: [1..4] + leaf [5..8]
    put(cache, toks)
    leaf = cache.match_prefix(toks).node
    receipt = cache.lock(leaf)
    assert receipt.swa_boundary is not None and receipt.swa_boundary == leaf.boundary_id
    assert leaf.full_lock == leaf.swa_lock == 1 and leaf.in_lru
    a = cache.allocator
    full0, swa0, ev0 = a.full_available_size(), a.swa_available_size(), cache.swa_evictable
    cache.drain_events()
    after = cache.release_window_lock(receipt)
    assert not after.holds_swa
    assert not leaf.is_tombstone and leaf.in_lru and leaf.swa_lock == 0 and leaf.full_lock == 1
    assert a.swa_available_size() == swa0 and a.full_available_size() == full0
    assert cache.swa_evictable == ev0 + 4 and cache.swa_protected == 0
    assert cache.drain_events() == []
    cache.check_integrity()
    assert cache.evict(0, 8).swa >= 4  # reclaimable: the full-locked leaf is tombstoned in place
    assert leaf.is_tombstone and leaf.full_lock == 1 and a.swa_available_size() >= swa0 + 4
    cache.unlock(after)
    assert cache.full_protected == cache.swa_protected == 0
    cache.check_integrity()


def test_early_release_keeps_internal_nodes_for_lazy_reclaim() -> None:
    """The boundary lies on the internal node; it becomes SWA-evictable, not freed."""
    cache = make_cache(1, 4, 128, 64)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # [1..4] + [5..8]
    put(cache, [1, 2, 3, 4, 5, 6, 7, 9], prev=4)  # splits [5..8] -> [5,6,7] + [8]
    leaf = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9]).node
    internal = node_at(cache, [1, 2, 3, 4, 5, 6, 7])
    assert leaf.key == (9,) and len(internal) == 3
    receipt = cache.lock(leaf)
    assert receipt.swa_boundary == internal.boundary_id
    prot0, ev0 = cache.swa_protected, cache.swa_evictable
    swa0 = cache.allocator.swa_available_size()
    receipt = cache.release_window_lock(receipt)
    assert not internal.is_tombstone and internal.in_lru and internal.swa_lock == 0
    assert not leaf.is_tombstone and leaf.in_lru
    assert cache.swa_protected == prot0 - 4 and cache.swa_evictable == ev0 + 4
    assert cache.allocator.swa_available_size() == swa0
    cache.unlock(receipt)
    cache.check_integrity()


@pytest.mark.parametrize("via_receipt", [True, False])
def test_final_unlock_after_release_drops_full_only(via_receipt: bool) -> None:
    """After early release the final unlock leaves SWA untouched."""
    cache = make_cache(1, 4, 128, 64)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    receipt = cache.lock(cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).node)
    released = cache.release_window_lock(receipt)
    swa_free, swa_prot = cache.allocator.swa_available_size(), cache.swa_protected
    if via_receipt:
        cache.unlock(released)
    else:
        cache.unlock(receipt, skip_swa=True)
    assert cache.allocator.swa_available_size() == swa_free and cache.swa_protected == swa_prot
    assert cache.full_protected == 0
    cache.check_integrity()


def test_plain_lock_unlock_frees_nothing() -> None:
    """Lock + unlock restore both counters; availability never changes."""
    cache = make_cache(1, 4, 128, 64)
    put(cache, list(range(1, 13)))
    a = cache.allocator
    sizes = (
        a.full_available_size(),
        a.swa_available_size(),
        cache.full_evictable,
        cache.swa_evictable,
    )
    node = cache.match_prefix(list(range(1, 13))).node
    receipt = cache.lock(node)
    assert cache.full_protected == 12 and cache.swa_protected == 4
    cache.unlock(receipt)
    assert node.full_lock == node.swa_lock == 0 and cache.full_protected == cache.swa_protected == 0
    assert sizes == (
        a.full_available_size(),
        a.swa_available_size(),
        cache.full_evictable,
        cache.swa_evictable,
    )
    cache.check_integrity()


@pytest.mark.parametrize("window", [4, 64])
def test_swa_evict_full_locked_leaf_tombstones_in_place(window: int) -> None:
    """An SWA-unlocked, full-locked leaf is tombstoned, not deleted."""
    cache = make_cache(1, window, 128, 64)
    leaf, receipt = locked_leaf_without_swa_lock(cache, [1, 2, 3, 4])
    swa0, ev0 = cache.allocator.swa_available_size(), cache.swa_evictable
    res = cache.evict(0, 4)
    assert res == EvictResult(0, 4)
    assert leaf.is_tombstone and not leaf.in_lru and leaf.full_lock == 1 and leaf.attached
    assert cache.allocator.swa_available_size() == swa0 + 4 and cache.swa_evictable == ev0 - 4
    cache.unlock(receipt)
    cache.check_integrity()


def test_deleting_a_tombstone_leaf_keeps_swa_counters() -> None:
    """Full eviction of a tombstoned leaf subtracts nothing from SWA."""
    cache = make_cache(1, 4, 128, 64)
    leaf, receipt = locked_leaf_without_swa_lock(cache, [1, 2, 3, 4])
    cache.evict(0, 4)
    cache.unlock(receipt)
    ev = cache.swa_evictable
    assert cache.evict(4, 0) == EvictResult(4, 0)
    assert cache.swa_evictable == ev and not leaf.attached
    cache.check_integrity()


@pytest.mark.parametrize("page,window", [(2, 4), (8, 4), (4, 6)])
def test_early_release_page_variants(page: int, window: int) -> None:
    """Release makes exactly the (capped) leaf's SWA evictable, full untouched."""
    cache = make_cache(page, window, 64 * page, 64 * page)
    n = -(-max(window, 2 * page) // page) * page
    toks = list(range(1, n + 1))
    put(cache, toks)
    leaf = cache.match_prefix(toks).node
    receipt = cache.lock(leaf)
    a = cache.allocator
    full0, swa0, ev0 = a.full_available_size(), a.swa_available_size(), cache.swa_evictable
    cache.unlock(cache.release_window_lock(receipt))
    assert cache.swa_evictable == ev0 + len(leaf) and a.swa_available_size() == swa0
    assert a.full_available_size() == full0
    assert len(leaf) == -(-window // page) * page
    cache.check_integrity()


def test_boundary_on_internal_node_with_pages() -> None:
    """P=2, W=6: leaf 2 under internal 4, boundary at the internal node."""
    cache = make_cache(2, 6, 128, 128)
    put(cache, [1, 2, 3, 4, 5, 6])
    put(cache, [1, 2, 3, 4, 7, 8], prev=4)
    leaf = cache.match_prefix([1, 2, 3, 4, 7, 8]).node
    internal = node_at(cache, [1, 2, 3, 4])
    receipt = cache.lock(leaf)
    assert receipt.swa_boundary == internal.boundary_id and cache.swa_protected == 6
    swa0, ev0 = cache.allocator.swa_available_size(), cache.swa_evictable
    receipt = cache.release_window_lock(receipt)
    assert not leaf.is_tombstone and cache.allocator.swa_available_size() == swa0
    assert cache.swa_evictable == ev0 + 6 and cache.swa_protected == 0
    cache.unlock(receipt)
    cache.check_integrity()


def test_boundary_moves_up_on_split() -> None:
    """A split of the boundary node hands the boundary to the upper part; unlock still
    releases exactly what lock took."""
    cache = make_cache(1, 8, 128, 64)
    put(cache, list(range(1, 9)))  # one leaf of 8 = one window
    node = cache.match_prefix(list(range(1, 9))).node
    receipt = cache.lock(node)
    boundary = node.boundary_id
    put(cache, [1, 2, 3, 50], prev=0)  # splits the locked node at 3
    upper = node_at(cache, [1, 2, 3])
    assert upper.boundary_id == boundary and node.boundary_id is None
    assert upper.full_lock == upper.swa_lock == 1
    cache.unlock(receipt)
    assert cache.full_protected == cache.swa_protected == 0
    cache.check_integrity()


def test_swa_lock_stops_at_window_and_at_tombstones() -> None:
    """SWA lock covers only the last `window` live tokens and never a tombstone."""
    cache = make_cache(1, 4, 128, 64)
    put(cache, list(range(1, 13)), evicted=4)  # T[1..4] + [5..8] + [9..12]
    receipt = cache.lock(cache.match_prefix(list(range(1, 13))).node)
    assert cache.swa_protected == 4 and cache.full_protected == 12
    cache.unlock(receipt)
    tomb = node_at(cache, [1, 2, 3, 4])
    receipt = cache.lock(tomb)
    assert not receipt.holds_swa and cache.full_protected == 4 and cache.swa_protected == 0
    cache.unlock(receipt)
    cache.check_integrity()
