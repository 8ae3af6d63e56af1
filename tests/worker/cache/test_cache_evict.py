"""Eviction and LRU order (docs/design.md §9.5, §9.6)."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import make_cache, node_at, put

from worker.cache.base import EvictResult
from worker.cache.lru import LeafHeap, LRUList
from worker.cache.node import Node


def chain(lens: list[int]) -> list[Node]:
    """Root → A → B → … with the given key lengths (no slots needed for list tests)."""
    root = Node.make_root()
    out, parent, t = [], root, 0
    for n in lens:
        node = Node(
            key=tuple(range(t, t + n)), full=torch.empty(0), swa=None, hashes=[], parent=parent
        )
        parent.children[node.key[:1]] = node
        out.append(node)
        parent, t = node, t + n
    return out


def names(order: list[Node], nodes: list[Node]) -> list[str]:
    return ["ABCD"[nodes.index(n)] for n in order]


def test_bounded_refresh_skips_unlisted_nodes_but_counts_them() -> None:
    """Lens [2,2,2,2], B not listed, budget 5 from D → [D, C, A]."""
    a, b, c, d = nodes = chain([2, 2, 2, 2])
    lru = LRUList()
    for n in (c, d, a):
        lru.push_newest(n)
    lru.refresh_upward(d, 5)
    assert names(lru.order_newest_first(), nodes) == ["D", "C", "A"]


def test_bounded_refresh_includes_the_crossing_node() -> None:
    """Lens [3,3,3,3], order [A,B,C,D], budget 5 from D → [D, C, A, B]."""
    a, b, c, d = nodes = chain([3, 3, 3, 3])
    lru = LRUList()
    for n in (d, c, b, a):
        lru.push_newest(n)
    lru.refresh_upward(d, 5)
    assert names(lru.order_newest_first(), nodes) == ["D", "C", "A", "B"]


def test_bounded_refresh_stops_at_root_and_zero_is_noop() -> None:
    """A huge budget stops at the root; budget 0 changes nothing."""
    a, b = nodes = chain([2, 2])
    lru = LRUList()
    lru.push_newest(b)
    lru.push_newest(a)
    lru.refresh_upward(b, 0)
    assert names(lru.order_newest_first(), nodes) == ["A", "B"]
    lru.refresh_upward(b, 1000)
    assert names(lru.order_newest_first(), nodes) == ["B", "A"]


def test_leaf_heap_pops_least_recent_member_only() -> None:
    """Stale heap entries (touched or discarded members) are skipped."""
    x, y, z = chain([1]) + chain([1]) + chain([1])
    heap = LeafHeap()
    for t, n in enumerate((x, y, z)):
        n.last_access = t
        heap.add(n)
    x.last_access = 10
    heap.touched(x)
    heap.discard(y)
    assert heap.pop_oldest() is z and heap.pop_oldest() is x and heap.pop_oldest() is None


SWA_CONFIGS_8_PAGES = [(1, 4), (4, 4), (4, 2), (16, 16), (128, 4)]  # 8 pages >= W + P


@pytest.mark.parametrize("page,window", SWA_CONFIGS_8_PAGES)
def test_swa_lru_is_window_bounded(page: int, window: int) -> None:
    """Refreshes touch only the window above the target, so the oldest ancestor is
    SWA-evicted first and a side branch stays matchable."""
    cache = make_cache(page, window, 96 * page, 96 * page)
    seg = [list(range(s * 1000, s * 1000 + 8 * page)) for s in range(5)]
    A, B, C, D, S = seg
    for toks in (A, A + B, A + B + C, A + S):
        put(cache, toks, prev=len(toks) - 8 * page)
    assert len(cache.tree.swa_lru) == 8
    lru = cache.tree.swa_lru

    def rank(toks: list[int]) -> list[int]:  # LRU positions (0 = newest) of its two nodes
        order = lru.order_newest_first()
        tail = node_at(cache, toks)
        return sorted([order.index(tail), order.index(tail.parent)])

    put(cache, A + B + C + D, prev=24 * page)
    assert max(rank(A + S)) < min(rank(A + B)) and max(rank(A + S)) < min(rank(A))
    cache.match_prefix(A + B + C)
    assert rank(A + B + C) == [0, 1]
    assert max(rank(A + S)) < min(rank(A + B)) < min(rank(A))
    assert rank(A) == [len(lru) - 2, len(lru) - 1]
    res = cache.evict(0, page)
    assert res.full == 0 and node_at(cache, A[: len(A) - len(node_at(cache, A))]).is_tombstone
    assert cache.match_prefix(A + S).length == len(A + S)
    for _ in range(3):
        assert cache.match_prefix(A + B + C + D).length == 32 * page
        cache.check_integrity()


def test_evict_empty_tree_and_lru_order_of_leaves() -> None:
    """An empty tree evicts 0; leaves go least recently used first."""
    cache = make_cache(4, 4, 256, 256)
    assert cache.evict(100, 100) == EvictResult(0, 0)
    for s in (100, 200, 300):
        put(cache, list(range(s, s + 4)))
    cache.match_prefix(list(range(100, 104)))  # 100 is now the newest
    ev0 = cache.full_evictable
    res = cache.evict(4, 0)
    assert res == EvictResult(4, 4) and cache.full_evictable == ev0 - res.full
    assert cache.match_prefix(list(range(200, 204))).length == 0
    assert cache.match_prefix(list(range(100, 104))).length == 4
    res = cache.evict(8, 0)
    assert res.full == 8 and cache.full_evictable == 0
    put(cache, list(range(100, 108)))  # reinsert after total eviction
    assert cache.match_prefix(list(range(100, 108))).length == 8
    cache.check_integrity()


def test_lock_protects_then_unlock_allows_eviction() -> None:
    """A locked path survives any eviction; after unlock it goes."""
    cache = make_cache(1, 4, 128, 64)
    put(cache, list(range(1, 9)))
    receipt = cache.lock(cache.match_prefix(list(range(1, 9))).node)
    res = cache.evict(100, 100)
    assert res.full == 0 and res.swa == 4  # the out-of-window upper node lost its SWA only
    assert cache.match_prefix(list(range(1, 9))).length == 8
    cache.unlock(receipt)
    assert cache.evict(100, 0).full == 8 and cache.full_evictable == 0
    cache.check_integrity()


def test_evicting_a_leaf_frees_both_components() -> None:
    """A deleted live leaf returns its full and its SWA slots."""
    cache = make_cache(4, 4, 64, 64)
    put(cache, list(range(8)))
    a = cache.allocator
    full0, swa0 = a.full_available_size(), a.swa_available_size()
    assert cache.evict(8, 0) == EvictResult(8, 8)
    assert a.full_available_size() == full0 + 8 and a.swa_available_size() == swa0 + 8
    assert not cache.tree.root.children
    cache.check_integrity()


def test_parent_becomes_evictable_leaf_after_child_goes_and_unlock() -> None:
    """A locked parent whose child is evicted becomes an evictable leaf on unlock."""
    cache = make_cache(4, 4, 64, 64)
    put(cache, list(range(4)))
    parent = cache.match_prefix(list(range(4))).node
    receipt = cache.lock(parent)
    put(cache, list(range(8)), prev=4)
    assert cache.evict(4, 0).full == 4 and parent.is_leaf and parent not in cache.tree.leaves
    cache.unlock(receipt)
    assert parent in cache.tree.leaves and cache.evict(4, 0).full == 4
    cache.check_integrity()


def test_iterative_cleanup_of_tombstone_ancestors() -> None:
    """Deleting the leaf of T → T → live chain removes the childless tombstones."""
    cache = make_cache(2, 2, 64, 64)
    put(cache, list(range(6)), evicted=4)  # T[0,4) + live [4,6)
    cache.tree.split(node_at(cache, [0, 1, 2, 3]), 2)  # T[0,2) T[2,4)
    assert cache.evict(1, 0) == EvictResult(6, 2)
    assert not cache.tree.root.children
    cache.check_integrity()


def test_swa_evict_internal_then_everything() -> None:
    """evict(0, 2 x swa_evictable) tombstones the base and removes the leaf."""
    cache = make_cache(4, 4, 64, 64)
    put(cache, list(range(12)))
    put(cache, list(range(12)) + list(range(100, 112)), prev=12)
    cache.evict(0, 2 * cache.swa_evictable)
    assert cache.swa_evictable == 0
    cache.check_integrity()
