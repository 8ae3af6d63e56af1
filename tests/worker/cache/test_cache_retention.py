"""Tail-first SWA retention and the repair revival (docs/design.md §9.5, §9.8)."""

from __future__ import annotations

import torch
from cache_helpers import _alloc, make_cache, node_at, put

from core.events import EventKind, page_hashes
from worker.cache.radix_cache import RadixCache
from worker.cache.req_kv import ReqKV
from worker.scheduler.kv_state import record

P, W = 4, 4  # one tail = 4 tokens


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def swa_removed(cache: RadixCache) -> list[int]:
    return [h for e in cache.drain_events() if e.kind is EventKind.SWA_REMOVED for h in e.page_hashes]


def test_a_single_child_head_is_interior_as_a_whole() -> None:
    """A 24-token insert is head [0,20) + leaf tail [20,24); the head's end is no match end
    (one child), so evicting 8 SWA tokens tombstones the whole head (its pages' SWA_REMOVED)
    and the full prompt still matches."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    toks = seq(1, 24)
    put(cache, toks)
    cache.drain_events()
    res = cache.evict(0, 8)
    assert (res.full, res.swa) == (0, 20)
    assert swa_removed(cache) == page_hashes(toks, P)[:5]
    assert cache.match_prefix(toks).length == 24
    m = cache.match_prefix(toks[:20])
    assert (m.length, m.full_length) == (0, 20)
    cache.check_integrity()


def test_a_branch_point_keeps_one_tail_and_a_short_leaf_reaches_into_its_parent() -> None:
    """Branch point S (two children) keeps its last T tokens; a leaf shorter than T keeps the
    rest of its window in the single-child node above it."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    system = seq(1, 16)
    put(cache, system + [50] * 8)
    put(cache, system + [60] * 8)  # S = [0,16) is a branch point now
    cache2 = make_cache(P, 2 * P, 128, 64, swa_eviction_policy="tail_first")
    assert cache2.tree.tail == 8
    put(cache2, seq(1, 20))
    put(cache2, seq(1, 24))  # chain: [0,12) ─ [12,20) ─ leaf [20,24)
    for c, ends in ((cache, [system, system + [50] * 8]), (cache2, [seq(1, 24)])):
        ret = c.tree.retention
        assert ret is not None
        c.evict(0, sum(len(n) - ret.keep(n) for n in ret.interior.members))
        assert len(ret.interior) == 0
        for end in ends:
            assert c.match_prefix(end).length == len(end)
        c.check_integrity()
    assert cache.swa_evictable == 4 + 4 + 4  # S's last page and each leaf
    assert cache2.swa_evictable == 4 + 4  # the leaf and the last page of the node above it


def test_tails_go_only_when_no_interior_is_left_and_stay_as_tombstones() -> None:
    """After the interior, tails are tombstoned oldest first; nothing is deleted."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    old, new = seq(1, 12), seq(100, 12)
    put(cache, old)
    put(cache, new)
    full_before = cache.full_evictable
    cache.drain_events()
    res = cache.evict(0, 16 + 4)  # both heads (8 each), then one tail
    assert (res.full, res.swa) == (0, 20)
    assert swa_removed(cache)[-1] == page_hashes(old, P)[-1], "the oldest tail goes first"
    assert cache.full_evictable == full_before, "the SWA phase deletes nothing"
    cache.evict(0, 64)
    assert cache.swa_evictable == 0 and cache.full_evictable == full_before
    assert cache.match_prefix(old).full_length == 12
    cache.check_integrity()


def test_lru_policy_deletes_unlocked_leaves_as_before() -> None:
    """`lru`: the oldest live node first, an unlocked leaf deleted whole with its tombstoned
    ancestors (SGLang's order); `tail_first` keeps the full KV."""
    for policy, want in (("lru", (24, 24)), ("tail_first", (0, 24))):
        cache = make_cache(P, W, 128, 64, swa_eviction_policy=policy)
        put(cache, seq(1, 24))
        res = cache.evict(0, 24)
        assert (res.full, res.swa) == want, policy
        cache.check_integrity()


def test_locked_interior_is_skipped() -> None:
    """An SWA-locked interior node keeps its SWA; the next interior node goes instead."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    a, b = seq(1, 12), seq(100, 12)
    put(cache, a)
    put(cache, b)
    receipt = cache.lock(node_at(cache, a[:8]))  # a's head, SWA-locked
    cache.drain_events()
    cache.evict(0, 4)
    assert swa_removed(cache) == page_hashes(b, P)[:2]
    cache.unlock(receipt)
    cache.check_integrity()


def _repairing(cache: RadixCache, tokens: list[int], rows: int) -> ReqKV:
    """What the scheduler sets up for a repair: the full match locked, scratch pairs for the
    repair rows, slots for the rest (docs/design.md §9.8)."""
    m = cache.match_full(tokens[:-1])
    receipt = cache.lock(m.node)
    scratch = _alloc(cache, [0], [rows], [-1])
    rest = _alloc(cache, [m.length], [len(tokens)], [-1])
    assert scratch is not None and rest is not None
    return ReqKV(
        tokens=list(tokens), table=torch.cat([m.indices, rest]), cache_protected_len=m.length,
        lock=receipt, kv_committed_len=m.length - rows, kv_allocated_len=len(tokens),
        repair_start=m.length - rows, repair_slots=scratch,
    )  # fmt: skip


def test_repair_revives_exactly_the_tail_and_locks_it() -> None:
    """Tombstoned 16-token prefix; a repair of 8 rows revives the last tail (4 tokens, one
    page) with its scratch SWA, frees the rest, and SWA-locks the revived tail."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    base = seq(1, 16)
    put(cache, base + [99] * 4)
    cache.evict(0, 64)
    assert cache.match_prefix(base).length == 0 and cache.match_prefix(base).full_length == 16
    req = _repairing(cache, base + [7, 7], rows=8)
    cache.check_integrity([req])
    cache.drain_events()
    req.kv_committed_len = len(req.tokens)
    record(req, cache.finish_repair(req))
    events = cache.drain_events()
    assert [(e.kind, e.page_hashes) for e in events] == [
        (EventKind.SWA_RESTORED, tuple(page_hashes(base, P)[3:]))
    ]
    assert cache.match_prefix(base).length == 16
    assert node_at(cache, base).swa_lock == 1 and not req.repairing
    cache.check_integrity([req])
    record(req, cache.cache_finished_req(req))
    cache.check_integrity()
    cache.reset()
    a = cache.allocator
    assert (a.full_available_size(), a.swa_available_size()) == (a.full_size, a.swa_size)


def test_repair_keeps_live_pages_and_an_aborted_repair_frees_its_scratch() -> None:
    """A tail page that is still live keeps its SWA (the scratch pair is freed); aborting
    before the revival gives every scratch slot back."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    base = seq(1, 16)
    put(cache, base)
    node = node_at(cache, base[:12])  # tombstone the head only; the tail page stays live
    cache.tree.tombstone(node)
    cache.allocator.free_swa(node.full)
    req = _repairing(cache, base + [5], rows=8)
    cache.drain_events()
    req.kv_committed_len = len(req.tokens)
    record(req, cache.finish_repair(req))
    assert cache.drain_events() == []
    record(req, cache.cache_finished_req(req))
    cache.check_integrity()
    aborted = _repairing(cache, base + [6], rows=8)
    free_swa = cache.allocator.swa_available_size()
    record(aborted, cache.cache_finished_req(aborted))
    assert cache.allocator.swa_available_size() == free_swa + 8 + P  # scratch + its one page
    cache.check_integrity()


def test_a_tail_a_match_ended_at_outlives_older_tails_on_probation() -> None:
    """Segmented order among tails: a matched end (a tenant's system prompt) stays while
    never-matched tails go first, even newer ones."""
    cache = make_cache(P, W, 128, 64, swa_eviction_policy="tail_first")
    system, other = seq(1, 8), seq(200, 8)
    put(cache, system)
    put(cache, other)  # newer than `system`, never matched
    assert cache.match_prefix(system + [3]).length == 8  # a match ends at system's end
    assert cache.evict(0, 8 + 4).swa == 12  # both heads (interior), then one tail
    assert not node_at(cache, system).is_tombstone
    assert node_at(cache, other).is_tombstone
    cache.check_integrity()
