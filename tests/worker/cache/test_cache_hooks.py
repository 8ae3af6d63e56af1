"""Request hooks with the real frontier (docs/design.md §7, §10)."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import decode, make_cache, move_frontier, node_at, start_req

from core.geometry import floor_page
from worker.cache.req_kv import ReqKV
from worker.scheduler.kv_state import record


def finish(cache, req: ReqKV, running: list[ReqKV] = (), insert: bool = True) -> None:
    record(req, cache.cache_finished_req(req, insert=insert))
    cache.check_integrity(running_reqs=[r for r in running if r is not req])


def test_finished_insert_makes_aligned_part_matchable() -> None:
    """floor_P(len) is matchable after finish; the unaligned tail is freed."""
    cache = make_cache(4, 4, 256, 256)
    req = start_req(cache, list(range(10)))
    cache.check_integrity(running_reqs=[req])
    finish(cache, req)
    assert cache.match_prefix(list(range(10))).length == 8
    a = cache.allocator
    assert a.full_available_size() == 256 - 8 and a.swa_available_size() == 256 - 8


def test_finish_without_insert_frees_everything() -> None:
    """insert=False returns every request-owned slot; the shared prefix stays."""
    cache = make_cache(4, 4, 256, 256)
    finish(cache, start_req(cache, list(range(8)) + [0]))
    req = start_req(cache, list(range(8)) + [50, 51, 52, 53, 54])
    assert req.cache_protected_len == 8
    finish(cache, req, insert=False)
    a = cache.allocator
    assert a.full_available_size() == 256 - 8 and cache.full_protected == 0
    assert cache.match_prefix(list(range(8)) + [50, 51, 52, 53]).length == 8


def test_unfinished_req_advances_protected_len_and_table() -> None:
    """Chunked prefill moves the lock and points the table at the tree's slots."""
    cache = make_cache(4, 4, 256, 256)
    finish(cache, start_req(cache, list(range(12)) + [0]))
    toks = list(range(16)) + [7, 7]
    req = start_req(cache, toks, match=False)  # a chunk that did not use the cache
    old = req.lock
    record(req, cache.cache_unfinished_req(req))
    assert req.cache_protected_len == 16 and req.lock is not old
    m = cache.match_prefix(toks[:16])
    assert torch.equal(req.table[:16], m.indices)
    cache.check_integrity(running_reqs=[req])
    decode(cache, req, [1, 2, 3])
    record(req, cache.cache_unfinished_req(req))
    assert req.cache_protected_len == 20
    finish(cache, req, [req])
    assert cache.full_protected == 0


def test_unfinished_req_preserves_frontier() -> None:
    """A chunk inserted with its frontier is a tombstone + live leaf."""
    cache = make_cache(1, 4, 64, 64)
    req = start_req(cache, list(range(1, 10)), match=False)
    req.kv_committed_len = 8
    cache.allocator.free_swa(req.table[:4])
    req.swa_evicted_seqlen = 4
    record(req, cache.cache_unfinished_req(req))
    (top,) = cache.tree.root.children.values()
    (leaf,) = top.children.values()
    assert len(top) == 4 and top.is_tombstone and len(leaf) == 4 and not leaf.is_tombstone
    assert cache.match_prefix(list(range(1, 9))).length == 8
    cache.check_integrity(running_reqs=[req])
    finish(cache, req, [req])


def test_revival_keeps_a_locked_full_value() -> None:
    """Another request reads the tombstone's full slots; the new request's
    SWA is adopted through the mapping and only its full slots are freed."""
    cache = make_cache(1, 4, 64, 64)
    first = start_req(cache, [1, 2, 3, 4, 0], match=False)
    first.kv_committed_len = 4  # the last slot is spare: freed at finish
    finish(cache, first)
    finish(cache, start_req(cache, [1, 2, 3, 4, 5, 6]))  # nodes [1..4] + [5]
    node = node_at(cache, [1, 2, 3, 4])
    assert cache.evict(0, 4).swa == 4 and node.is_tombstone
    holder = cache.lock(node)
    old_full = node.full.clone()
    req = start_req(cache, [1, 2, 3, 4, 9], match=False)
    req.kv_committed_len = 4
    new_swa = cache.allocator.translate(req.table[:4]).clone()
    full0 = cache.allocator.full_available_size()
    record(req, cache.cache_unfinished_req(req))
    assert cache.allocator.full_available_size() == full0 + 4
    assert torch.equal(node.full, old_full) and torch.equal(node.swa, new_swa)
    assert torch.equal(cache.allocator.translate(old_full), new_swa)
    assert req.cache_protected_len == 4 and torch.equal(req.table[:4], old_full)
    cache.check_integrity(running_reqs=[req])
    cache.unlock(holder)
    finish(cache, req, [req])


def test_eager_swa_free_on_unfinished_req() -> None:
    """Eager freeing: 20 committed tokens → frontier 15, >= 15 SWA slots back."""
    cache = make_cache(1, 4, 64, 64, eager_swa_free=True)
    req = start_req(cache, list(range(20)), match=False)
    swa0 = cache.allocator.swa_available_size()
    record(req, cache.cache_unfinished_req(req))
    assert req.swa_evicted_seqlen == 15 and cache.allocator.swa_available_size() >= swa0 + 15
    assert cache.match_prefix(list(range(20))).length == 20
    cache.check_integrity(running_reqs=[req])
    finish(cache, req, [req])
    short = start_req(cache, [90, 91, 92, 93, 94], match=False)
    record(short, cache.cache_unfinished_req(short))
    assert short.swa_evicted_seqlen == 0
    finish(cache, short, [short])


def test_eager_swa_free_off_by_default() -> None:
    """Without eager freeing the chunk keeps all its SWA."""
    cache = make_cache(1, 4, 64, 64)
    req = start_req(cache, list(range(20)), match=False)
    record(req, cache.cache_unfinished_req(req))
    assert req.swa_evicted_seqlen == 0 and cache.swa_evictable + cache.swa_protected == 20
    finish(cache, req, [req])


@pytest.mark.parametrize("seq_len", [13, 17, 25, 33])
def test_page_le_window_finish(seq_len: int) -> None:
    """P=4, W=8: the frontier stays below the insert boundary; finish keeps integrity."""
    cache = make_cache(4, 8, 1024, 512)
    req = start_req(cache, list(range(seq_len)), match=False)
    assert move_frontier(cache, req) < floor_page(seq_len, 4)
    cache.check_integrity(running_reqs=[req])
    finish(cache, req, [req])
    assert cache.match_prefix(list(range(seq_len))).length == floor_page(seq_len, 4)


def test_p1_reinserting_the_same_prefix() -> None:
    """P=1, W=4: requests that evicted their own window re-insert over tombstones."""
    cache = make_cache(1, 4, 1024, 512)
    for seq_len in range(6, 30):
        req = start_req(cache, list(range(seq_len)), match=False)
        assert move_frontier(cache, req) == max(0, seq_len - 1 - 4)
        cache.check_integrity(running_reqs=[req])
        finish(cache, req, [req])
        assert cache.match_prefix(list(range(seq_len))).length == seq_len


def test_insert_case_1_frontier_below_shared_prefix() -> None:
    """P=8, W=2: frontier 0; the new page adds exactly 8 evictable SWA tokens."""
    cache = make_cache(8, 2, 1024, 512)
    finish(cache, start_req(cache, list(range(16)), match=False))
    ev0 = cache.swa_evictable
    req = start_req(cache, list(range(24)), match=False)
    req.kv_committed_len = 16  # the out-of-window pass ran at pre_len 15
    assert move_frontier(cache, req) == 0
    req.kv_committed_len = 24
    finish(cache, req, [req])
    assert cache.swa_evictable == ev0 + 8


def test_insert_case_2_tombstone_prefix() -> None:
    """P=8, W=2, seq 25: frontier 16, tombstone [0,16) + live [16,24)."""
    cache = make_cache(8, 2, 1024, 512)
    req = start_req(cache, list(range(25)), match=False)
    assert move_frontier(cache, req) == 16
    finish(cache, req, [req])
    assert cache.swa_evictable == 8 and cache.full_evictable == 24
    assert cache.match_prefix(list(range(25))).length == 24


def test_insert_case_3_whole_leaf_out_of_window() -> None:
    """Defensive (a frontier at the insert boundary): our choice keeps a FULL-only leaf."""
    cache = make_cache(8, 2, 1024, 512)
    req = start_req(cache, list(range(11)), match=False)
    cache.allocator.free_swa(req.table[:8])
    req.swa_evicted_seqlen = 8
    swa_ev = cache.swa_evictable
    finish(cache, req, [req])
    assert cache.swa_evictable == swa_ev and cache.full_evictable == 8
    assert node_at(cache, list(range(8))).is_tombstone


def test_multiple_decode_turns() -> None:
    """P=8, W=2: turns of growing length, each frontier below the boundary."""
    cache = make_cache(8, 2, 1024, 512)
    for turn in range(4):
        seq_len = 8 * (turn + 2) + 1
        req = start_req(cache, list(range(seq_len)))
        assert move_frontier(cache, req) < floor_page(seq_len, 8)
        cache.check_integrity(running_reqs=[req])
        finish(cache, req, [req])


@pytest.mark.parametrize("seq_len", [10, 20, 30])
def test_p1_full_flow(seq_len: int) -> None:
    """P=1, W=4: frontier = seq - 5; finish and integrity."""
    cache = make_cache(1, 4, 1024, 512)
    req = start_req(cache, list(range(seq_len)), match=False)
    assert move_frontier(cache, req) == seq_len - 5
    finish(cache, req, [req])


def test_decode_past_window_with_early_release_and_frontier() -> None:
    """A matched request decodes past the window: early release, frontier, finish — the pool
    identity holds at every step."""
    cache = make_cache(4, 4, 256, 128)
    finish(cache, start_req(cache, list(range(17))))
    req = start_req(cache, list(range(16)) + [70, 71])
    assert req.cache_protected_len == 16
    for step in range(6):
        assert decode(cache, req, [100 + step] * 3)
        move_frontier(cache, req)
        if step == 1:
            req.lock = cache.release_window_lock(req.lock)
            req.swa_lock_released = True
        cache.check_integrity(running_reqs=[req])
    finish(cache, req, [req])
    assert cache.full_protected == cache.swa_protected == 0


def test_finish_uses_cache_protected_len() -> None:
    """Insert gets prev_prefix_len = cache_protected_len; without
    insert exactly [protected, aligned) and then the unaligned tail are freed."""
    cache = make_cache(1, 4, 64, 64)
    first = start_req(cache, [1, 2])
    first.kv_committed_len = 1
    finish(cache, first)  # the tree holds [1]
    req = start_req(cache, [1, 2, 3, 4, 5, 6])
    assert req.cache_protected_len == 1
    freed: list[list[int]] = []
    real_free = cache.allocator.free
    cache.allocator.free = lambda idx: (freed.append(idx.tolist()), real_free(idx))[1]
    table = req.table.tolist()
    req.kv_committed_len = 5  # position 5 is allocated but never committed: the tail
    record(req, cache.cache_finished_req(req, insert=False))
    assert freed == [table[1:5], table[5:6]]
    cache.check_integrity()

    calls = []
    real_insert = cache.insert
    cache.insert = lambda *a, **kw: (calls.append(kw), real_insert(*a, **kw))[1]
    finish(cache, start_req(cache, [1, 2, 3]))
    assert calls[-1]["prev_prefix_len"] == 1


def test_locked_revival_splits_at_frontier() -> None:
    """R2 with a full-locked tombstone: the part below the frontier stays a tombstone, the
    rest adopts the request's SWA through the mapping; only request full slots are freed."""
    cache = make_cache(1, 4, 64, 64)
    first = start_req(cache, list(range(1, 10)), match=False)
    first.kv_committed_len = 8
    cache.allocator.free_swa(first.table[:8])
    first.swa_evicted_seqlen = 8
    finish(cache, first)  # a FULL-only leaf [1..8]
    node = node_at(cache, list(range(1, 9)))
    holder = cache.lock(node)
    old_full = node.full.clone()
    req = start_req(cache, list(range(1, 10)), match=False)
    req.kv_committed_len = 8
    cache.allocator.free_swa(req.table[:2])
    req.swa_evicted_seqlen = 2
    full0, swa0 = cache.allocator.full_available_size(), cache.allocator.swa_available_size()
    record(req, cache.cache_unfinished_req(req))
    upper = node_at(cache, [1, 2])
    assert upper.is_tombstone and not node.is_tombstone and len(node) == 6
    assert torch.equal(node.full, old_full[2:])  # locked: the node keeps its full slots
    assert torch.equal(cache.allocator.translate(old_full[2:]), node.swa)
    assert cache.allocator.full_available_size() == full0 + 8  # all of the request's 8
    assert cache.allocator.swa_available_size() == swa0  # its 6 live SWA slots were adopted
    assert torch.equal(req.table[:8], old_full) and req.cache_protected_len == 8
    cache.check_integrity(running_reqs=[req])
    cache.unlock(holder)
    finish(cache, req, [req])
