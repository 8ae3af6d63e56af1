"""The host tier in the tree (docs/design.md §9.9): eviction offloads instead of dropping, the
host tier evicts by its own LRU, a match counts host pages with the window rule over device ∪
host SWA (== the reference walk `tiered_match`), loads bring back the full KV of the prefix and
the SWA of its window only, an insert adopts recomputed host nodes, events replay to the
snapshot through every tier kind, and a flush empties both tiers. A stateful run mixes all of it
with `check_integrity` after every step, its requests under three root hashes (no cache salt, two
salts: docs/design.md §9.10), each tier working per root."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import _alloc, load_all, make_cache, put, states
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from core.events import ROOT_HASH, EventKind, PageState, replay, salted_root
from core.geometry import Geometry
from core.reuse import tiered_match
from worker.cache.radix_cache import RadixCache
from worker.cache.req_kv import ReqKV
from worker.kv.transfer import Move
from worker.models.spec import LayerKind
from worker.scheduler.kv_state import record

L, T, SH, H, HT = (PageState.LIVE, PageState.TOMBSTONE, PageState.SWA_HOST, PageState.HOST,
                   PageState.HOST_TOMBSTONE)  # fmt: skip
TIER_KINDS = {EventKind.OFFLOADED, EventKind.LOADED, EventKind.SWA_OFFLOADED, EventKind.SWA_LOADED}


def synced(cache: RadixCache, pages: dict) -> dict:
    replay(cache.drain_events(), pages)
    assert pages == cache.snapshot_pages()
    return pages


def test_full_eviction_offloads_and_a_load_brings_back_only_the_window_swa() -> None:
    """A leaf's full and SWA KV go to the host (OFFLOADED); the match is valid over host pages
    (p_valid 8, p_device 0); loading takes the full KV of all 8 tokens and the SWA of the
    window's 4 only: [0, 4) SWA_HOST, [4, 8) LIVE."""
    cache = make_cache(2, 4, 32, 32, host=(64, 64))
    seq = list(range(1, 9))
    put(cache, seq)
    pages = synced(cache, {})
    assert cache.evict(8, 0).full == 8
    assert states(cache, seq) == [H] * 4 and cache.full_evictable == 0
    synced(cache, pages)
    m = cache.match_prefix(seq + [0])
    assert m.tiered is not None and (m.length, m.tiered.p_valid) == (0, 8)
    assert (m.tiered.host_full, m.tiered.host_swa) == (8, 4)
    assert m.tiered == tiered_match(states(cache, seq), Geometry(2, 4))
    assert load_all(cache, seq + [0]) == 8
    assert states(cache, seq) == [SH, SH, L, L]
    kinds = [e.kind for e in cache.drain_events()]  # the node split at the window: two LOADED
    assert kinds == [EventKind.LOADED, EventKind.LOADED, EventKind.SWA_LOADED]
    tier = cache.tier
    assert tier is not None and tier.tokens_loaded == 8 and tier.tokens_offloaded == 8
    assert tier.queue.moved[Move.LOAD, LayerKind.FULL] == 8
    assert tier.queue.moved[Move.LOAD, LayerKind.SWA] == 4
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "tail_first"])
def test_swa_eviction_offloads_so_the_prefix_stays_valid(policy: str) -> None:
    """SWA pressure moves SWA to the host (interior and tails, either policy): nothing is
    tombstoned, the whole prefix stays valid over device ∪ host, full KV stays on the device."""
    cache = make_cache(2, 4, 64, 32, host=(64, 64), swa_eviction_policy=policy)
    seq = list(range(1, 21))
    put(cache, seq)
    receipt = cache.lock(cache.match_prefix(seq).node)  # full-locked: only SWA can go
    cache.unlock(receipt, skip_swa=False)
    receipt = cache.release_window_lock(cache.lock(cache.match_prefix(seq).node))
    cache.evict(0, 20)
    assert set(states(cache, seq)) == {SH}
    m = cache.match_prefix(seq + [0])
    assert m.tiered is not None and m.tiered.p_valid == 20 and m.tiered.host_full == 0
    cache.unlock(receipt, skip_swa=True)
    assert replay(cache.drain_events()) == cache.snapshot_pages()
    cache.check_integrity()


def test_host_tier_evicts_its_least_recent_leaf_then_the_kv_is_gone() -> None:
    """A host full pool of one sequence: offloading a second deletes the first (REMOVED)."""
    cache = make_cache(2, 4, 32, 32, host=(8, 8))
    a, b = list(range(1, 9)), list(range(11, 19))
    put(cache, a)
    cache.evict(8, 0)
    put(cache, b)
    pages = synced(cache, {})
    cache.evict(8, 0)
    replay(cache.drain_events(), pages)  # (b is two nodes: the insert capped its leaf)
    assert pages == cache.snapshot_pages()
    assert states(cache, a) == [None] * 4 and states(cache, b) == [H] * 4
    cache.check_integrity()


def test_insert_over_host_nodes_adopts_the_recomputed_kv() -> None:
    """A request that recomputed a host-resident prefix inserts it: the nodes take its device
    KV (LOADED, SWA_LOADED) and their host slots go back, without any copy."""
    cache = make_cache(2, 4, 32, 32, host=(64, 64))
    seq = list(range(1, 9))
    put(cache, seq)
    cache.evict(8, 0)
    cache.drain_events()
    tier = cache.tier
    assert tier is not None
    before = len(tier.queue)
    put(cache, seq)
    assert states(cache, seq) == [L] * 4 and len(tier.queue) == before
    assert tier.host.available(LayerKind.FULL) == 64 and tier.host.available(LayerKind.SWA) == 64
    assert {e.kind for e in cache.drain_events()} == {EventKind.LOADED, EventKind.SWA_LOADED}
    cache.check_integrity()


def test_events_replay_to_the_snapshot_through_every_tier_kind() -> None:
    """offloaded, swa_offloaded, loaded, swa_loaded and swa_removed of host SWA replay; a
    reset with nothing locked leaves both tiers empty (one CLEARED)."""
    cache = make_cache(2, 4, 64, 32, host=(64, 16), swa_eviction_policy="tail_first")
    pages: dict = {}
    kinds: set = set()

    def sync() -> None:
        events = cache.drain_events()
        kinds.update(e.kind for e in events)
        replay(events, pages)
        assert pages == cache.snapshot_pages()
        cache.check_integrity()

    seq = list(range(1, 21))
    put(cache, seq)
    cache.evict(0, 12)  # interior SWA -> host
    sync()
    cache.evict(20, 0)  # full -> host; host SWA full: some SWA is dropped from the host
    sync()
    assert load_all(cache, seq + [0]) == 20
    sync()
    cache.reset()
    sync()
    assert TIER_KINDS <= kinds and EventKind.CLEARED in kinds
    tier = cache.tier
    assert tier is not None and pages == {}
    assert tier.host.available(LayerKind.FULL) == 64 and tier.host.available(LayerKind.SWA) == 16
    a = cache.allocator
    assert (a.full_available_size(), a.swa_available_size()) == (64, 32)


# ---- a stateful run ------------------------------------------------------------------------------

tokens_st = st.lists(st.integers(0, 2), min_size=3, max_size=16)
roots_st = st.sampled_from((ROOT_HASH, salted_root("tenant-a"), salted_root("tenant-b")))


class TierMachine(RuleBasedStateMachine):
    """Requests (match, load, allocate, finish or abort) interleaved with device and host
    eviction; a reference page model from the events, and every invariant after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = make_cache(2, 3, 40, 24, host=(32, 16), swa_eviction_policy=POLICY)
        self.pages: dict = {}
        self.running: list[ReqKV] = []

    @rule(tokens=tokens_st, root=roots_st, finish=st.booleans(), insert=st.booleans())
    def request(self, tokens: list[int], root: int, finish: bool, insert: bool) -> None:
        c = self.cache
        n = load_all(c, tokens[:-1], root)
        m = c.match_prefix(tokens[:-1], root)
        assert m.length == n, "a load leaves the prefix valid on the device"
        lock = c.lock(m.node)
        new = _alloc(c, [n], [len(tokens)], [-1])
        req = ReqKV(tokens=list(tokens), root_hash=root, table=torch.cat([m.indices, new]) if new is not None else m.indices,
                    cache_protected_len=n, lock=lock, kv_committed_len=len(tokens) if new is not None else n,
                    kv_allocated_len=len(tokens) if new is not None else n)  # fmt: skip
        self.running.append(req)
        if finish or new is None:
            self._finish(req, insert)

    @rule(insert=st.booleans())
    def finish_oldest(self, insert: bool) -> None:
        if self.running:
            self._finish(self.running[0], insert)

    def _finish(self, req: ReqKV, insert: bool) -> None:
        record(req, self.cache.cache_finished_req(req, insert=insert))
        self.running.remove(req)

    @rule(full=st.integers(0, 24), swa=st.integers(0, 24))
    def evict(self, full: int, swa: int) -> None:
        self.cache.evict(full, swa)

    @rule(full=st.integers(0, 32), swa=st.integers(0, 16))
    def host_evict(self, full: int, swa: int) -> None:
        tier = self.cache.tier
        assert tier is not None
        tier.evict(self.cache.tree, full, swa)

    @rule(tokens=tokens_st, root=roots_st)
    def probe(self, tokens: list[int], root: int) -> None:
        """The tree's tiered match equals the reference walk over the snapshot's states (of
        the root's own chain: another salt's pages never count)."""
        c = self.cache
        m = c.match_prefix(tokens, root)
        key = tokens[: len(tokens) // 2 * 2]
        assert m.tiered == tiered_match(states(c, key, root), Geometry(2, 3))

    @invariant()
    def consistent(self) -> None:
        replay(self.cache.drain_events(), self.pages)
        assert self.pages == self.cache.snapshot_pages()
        self.cache.check_integrity(self.running)

    def teardown(self) -> None:
        for req in list(self.running):
            self._finish(req, True)
        self.cache.reset()
        tier = self.cache.tier
        assert tier is not None
        assert tier.host.available(LayerKind.FULL) == 32 and tier.host.available(LayerKind.SWA) == 16
        assert self.cache.allocator.full_available_size() == 40


POLICY = "lru"


@pytest.mark.parametrize("policy", ["lru", "tail_first"])
def test_stateful_tiers(policy: str) -> None:
    """Random interleavings keep every invariant of both tiers."""
    global POLICY
    POLICY = policy
    run_state_machine_as_test(
        TierMachine,
        settings=settings(max_examples=25, stateful_step_count=25, deadline=None,
                          suppress_health_check=list(HealthCheck)),  # fmt: skip
    )
