"""Cache salts in the tree (docs/design.md §9.10): a root per salt, so the same prompt under two
salts shares no node, no slot and no page hash; the same salt shares as without one; a salt's
root goes with its last node; the host tier offloads and loads per root; integrity covers every
root and fails on a planted violation of each root rule."""

from __future__ import annotations

import pytest
from cache_helpers import load_all, make_cache, put, start_req, states

from core.events import ROOT_HASH, PageState, page_hashes, replay, salted_root
from worker.cache.node import Node
from worker.scheduler.kv_state import record

A, B = salted_root("tenant-a"), salted_root("tenant-b")
SEQ = list(range(1, 13))


def test_salted_roots_are_distinct_from_each_other_and_from_no_salt() -> None:
    """No salt keeps today's chain (ROOT_HASH); each salt starts its own, deterministically."""
    assert salted_root(None) == ROOT_HASH
    assert len({ROOT_HASH, A, B, salted_root("")}) == 4
    assert salted_root("tenant-a") == A


def test_the_same_prompt_under_two_salts_shares_nothing() -> None:
    """Inserted under salt A, the prompt matches in full for A and not at all for B or no salt;
    inserted under B too, it is held twice (distinct slots, pages named by each salt's chain)."""
    cache = make_cache(2, 4, 64, 64)
    put(cache, SEQ, root=A)
    assert cache.match_prefix(SEQ, A).length == 12
    assert cache.match_prefix(SEQ, B).length == 0
    assert cache.match_prefix(SEQ).length == 0
    out, _ = put(cache, SEQ, root=B)
    assert out.prefix_len == 0
    a, b = cache.match_prefix(SEQ, A), cache.match_prefix(SEQ, B)
    assert set(a.indices.tolist()).isdisjoint(b.indices.tolist())
    pages = cache.snapshot_pages()
    for root in (A, B):
        assert all(pages.get(h) is PageState.LIVE for h in page_hashes(SEQ, 2, root))
    assert not set(page_hashes(SEQ, 2)) & pages.keys()
    assert replay(cache.drain_events()) == pages
    cache.check_integrity()


def test_the_same_salt_shares_a_prefix() -> None:
    """Two requests of one salt share their common prefix, as two unsalted requests do."""
    cache = make_cache(2, 4, 64, 64)
    put(cache, SEQ, root=A)
    out, _ = put(cache, SEQ[:8] + [90, 91, 92, 93], prev=0, root=A)
    assert out.prefix_len == 8
    assert cache.match_prefix(SEQ[:8] + [90, 91, 92], A).length == 10
    cache.check_integrity()


def test_request_hooks_insert_under_the_requests_root() -> None:
    """A finished request with salt A leaves its KV where A's next request finds it, and only
    there."""
    cache = make_cache(2, 4, 64, 64)
    req = start_req(cache, SEQ + [0], root=A)
    assert req is not None
    record(req, cache.cache_finished_req(req))
    assert cache.match_prefix(SEQ, A).length == 12
    assert cache.match_prefix(SEQ, B).length == 0 and cache.match_prefix(SEQ).length == 0
    follow = start_req(cache, SEQ + [0], root=A)
    assert follow is not None and follow.cache_protected_len == 12
    cache.check_integrity(running_reqs=[follow])
    record(follow, cache.cache_finished_req(follow))
    cache.check_integrity()


def test_a_salts_root_goes_with_its_last_node() -> None:
    """Eviction of a salt's last node drops its root: salts a client makes up leave nothing."""
    cache = make_cache(2, 4, 64, 64)
    put(cache, SEQ, root=A)
    put(cache, SEQ)
    assert cache.tree.roots.keys() == {ROOT_HASH, A}
    cache.evict(64, 0)
    assert cache.tree.roots == {ROOT_HASH: cache.tree.root}
    cache.check_integrity()
    put(cache, SEQ, root=A)
    cache.reset()
    assert cache.tree.roots == {ROOT_HASH: cache.tree.root}


def test_host_tier_offloads_and_loads_per_salt() -> None:
    """A salt's KV offloaded to the host tier matches (and loads) for that salt only."""
    cache = make_cache(2, 4, 32, 32, host=(64, 64))
    put(cache, SEQ[:8], root=A)
    cache.evict(8, 0)
    assert states(cache, SEQ[:8], A) == [PageState.HOST] * 4
    other = cache.match_prefix(SEQ[:8] + [0], B).tiered
    assert other is not None and (other.p_full, other.p_valid) == (0, 0)
    mine = cache.match_prefix(SEQ[:8] + [0], A).tiered
    assert mine is not None and mine.p_valid == 8 and mine.host_full == 8
    assert load_all(cache, SEQ[:8] + [0], B) == 0
    assert load_all(cache, SEQ[:8] + [0], A) == 8
    assert cache.match_prefix(SEQ[:8] + [0], A).length == 8
    cache.check_integrity()


def _misfiled(cache) -> None:
    cache.tree.roots[B] = cache.tree.roots.pop(A)


def _empty_kept(cache) -> None:
    cache.tree.roots[B] = Node.make_root(B)


def _unlocked(cache) -> None:
    cache.tree.roots[A].full_lock = 0


@pytest.mark.parametrize("plant", [_misfiled, _empty_kept, _unlocked])
def test_integrity_fails_on_a_planted_root_violation(plant) -> None:
    """A root filed under another hash, an empty salt root kept, an unlocked root: each is named."""
    cache = make_cache(2, 4, 64, 64)
    put(cache, SEQ, root=A)
    cache.check_integrity()
    plant(cache)
    with pytest.raises(AssertionError, match="radix cache integrity: root"):
        cache.check_integrity()
