"""Chunk cache, all-SWA use, plain radix cache (no window / one pool), reset and events."""

from __future__ import annotations

import pytest
from cache_helpers import decode, make_cache, move_frontier, node_at, put, start_req

from core.events import EventKind, PageState, page_hashes, replay
from core.geometry import Geometry
from worker.cache import create_cache
from worker.cache.chunk_cache import ChunkCache
from worker.cache.req_kv import ReqKV
from worker.kv.frontier import free_out_of_window
from worker.kv.hybrid_allocator import HybridAllocator
from worker.scheduler.kv_state import record

pytestmark = pytest.mark.usefixtures("both_policies")


def test_chunk_cache_hooks_free_everything_at_finish() -> None:
    """Radix disabled: nothing matches or is evictable; finish frees the whole table,
    the window-freed hole included (the mapping makes that a no-op for SWA)."""
    alloc = HybridAllocator(128, 64, 4)
    cache = create_cache(alloc, Geometry(4, 4), enable_radix_cache=False)
    assert isinstance(cache, ChunkCache)
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 0
    table = alloc.alloc(22)
    req = ReqKV(tokens=list(range(22)), table=table, kv_committed_len=21, kv_allocated_len=22)
    record(req, cache.cache_unfinished_req(req))
    req.swa_evicted_seqlen = free_out_of_window(
        alloc, table, Geometry(4, 4), evicted=0, protected=0, pre_len=20, chunk_cache=True
    )
    assert req.swa_evicted_seqlen == 16 and alloc.swa_available_size() == 64 - 24 + 16
    cache.check_integrity(running_reqs=[req])
    assert cache.evict(100, 100).full == 0
    record(req, cache.cache_finished_req(req))
    assert alloc.full_available_size() == 128 and alloc.swa_available_size() == 64
    cache.check_integrity()


def test_all_swa_never_recaches_freed_kv() -> None:
    """All-SWA models (virtual full pool): a decoded request's out-of-window span is cached
    as tombstones only, so its freed SWA is never handed out twice."""
    cache = make_cache(4, 4, 256, 64)  # full slots are virtual addresses for an all-SWA model
    req = start_req(cache, list(range(9)), match=False)
    for step in range(5):
        assert decode(cache, req, [50 + step] * 4)
        move_frontier(cache, req)
        cache.check_integrity(running_reqs=[req])
    evicted = req.swa_evicted_seqlen
    assert evicted > 0
    record(req, cache.cache_finished_req(req))
    pages = cache.snapshot_pages()
    hashes = page_hashes(req.tokens, 4)
    assert all(pages[h] is PageState.TOMBSTONE for h in hashes[: evicted // 4])
    assert all(pages[h] is PageState.LIVE for h in hashes[evicted // 4 :])
    live = sum(len(n) for n in cache.tree.iter_nodes() if not n.is_tombstone)
    assert cache.allocator.swa_available_size() == 64 - live
    assert cache.match_prefix(req.tokens[:-1]).length == 28  # ends in the live tail
    assert cache.match_prefix(req.tokens[:evicted]).length == 0  # freed span: not reusable
    cache.check_integrity()


def test_plain_cache_without_window_never_tombstones() -> None:
    """window None: SWA requests become full evictions; no tombstones, no capping."""
    for hybrid in (True, False):
        alloc = HybridAllocator(128, 128, 2, hybrid)
        cache = create_cache(alloc, Geometry(2, None))
        put(cache, list(range(20)))
        put(cache, list(range(10)) + [99, 98], prev=10)
        assert len(node_at(cache, list(range(20)))) == 10  # split by the branch, not capped
        receipt = cache.lock(cache.match_prefix(list(range(20))).node)
        assert cache.swa_protected == cache.full_protected == 20
        cache.unlock(receipt)
        res = cache.evict(0, 2)
        assert res.full == res.swa == 2
        kinds = {e.kind for e in cache.drain_events()}
        assert kinds == {EventKind.STORED, EventKind.REMOVED}
        cache.check_integrity()


def test_one_pool_disables_the_window_rule() -> None:
    """hybrid=False (SWA layers keep all their KV): the window rule does not apply."""
    alloc = HybridAllocator(128, 128, 1, hybrid=False)
    cache = create_cache(alloc, Geometry(1, 4))
    req = start_req(cache, list(range(12)), match=False)
    record(req, cache.cache_finished_req(req))
    assert cache.evict(0, 4).swa >= 4 and not any(n.is_tombstone for n in cache.tree.iter_nodes())
    cache.check_integrity()


def test_reset_without_locks_clears_everything() -> None:
    """reset() with nothing locked: both pools fully free, one CLEARED event."""
    cache = make_cache(4, 4, 128, 64)
    put(cache, list(range(16)))
    put(cache, list(range(8)) + list(range(50, 58)), prev=8)
    cache.evict(0, 4)
    cache.drain_events()
    cache.reset()
    a = cache.allocator
    assert a.full_available_size() == 128 and a.swa_available_size() == 64
    assert [e.kind for e in cache.drain_events()] == [EventKind.CLEARED]
    assert cache.snapshot_pages() == {} and cache.full_evictable == cache.swa_evictable == 0
    cache.check_integrity()


def test_reset_with_a_lock_frees_only_unlocked_content() -> None:
    """reset() while a request holds a prefix: everything else goes, the prefix stays."""
    cache = make_cache(4, 4, 128, 64)
    put(cache, list(range(16)))
    put(cache, list(range(100, 108)))
    receipt = cache.lock(cache.match_prefix(list(range(16))).node)
    cache.reset()
    assert cache.full_evictable == 0 and cache.swa_evictable == 0
    assert cache.match_prefix(list(range(16))).length == 16
    cache.unlock(receipt)
    assert replay(cache.drain_events()) == cache.snapshot_pages()
    cache.check_integrity()


def test_event_replay_reproduces_pages_through_every_kind() -> None:
    """stored, stored_full_only, swa_removed, swa_restored, removed, cleared all replay (the
    host tier's kinds: test_cache_tiers.py)."""
    cache = make_cache(1, 4, 128, 64)
    pages: dict = {}
    kinds: set = set()

    def sync() -> None:
        events = cache.drain_events()
        kinds.update(e.kind for e in events)
        replay(events, pages)
        assert pages == cache.snapshot_pages()

    put(cache, list(range(1, 9)), evicted=8)  # FULL-only leaf
    sync()
    put(cache, list(range(1, 13)), prev=8)
    put(cache, list(range(1, 9)), evicted=2)  # revives [2, 8)
    sync()
    # Released but still full-locked: SWA eviction tombstones the leaf in place.
    receipt = cache.release_window_lock(cache.lock(node_at(cache, list(range(1, 13)))))
    cache.evict(0, 6)
    sync()
    cache.unlock(receipt)
    cache.evict(5, 0)
    sync()
    put(cache, [7, 7, 7, 7])
    cache.reset()
    sync()
    tier_kinds = {EventKind.OFFLOADED, EventKind.LOADED, EventKind.SWA_OFFLOADED, EventKind.SWA_LOADED}
    assert pages == {} and kinds == set(EventKind) - tier_kinds  # no host tier here
