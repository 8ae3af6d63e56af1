"""The index across the host tier: every page's state (core/events.py) follows the worker's
events exactly, the PageMap's bitsets say the same, and a stream the index cannot follow asks
for a resync."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.index import ApplyOutcome, ClusterIndex, IndexLimits
from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerResync
from cluster.page_map import HOST_FULL, HOST_SWA, PRESENT, TOMB
from core.events import CacheEvent, EventKind, PageState, replay, state_after
from core.geometry import Geometry
from core.reuse import TierCosts

K = EventKind
COSTS = TierCosts(prefill=1e-6, load_full=1e-7, load_swa=5e-8)


def _register(index: ClusterIndex, wid: str, full_tokens: int = 1 << 16, host_full_tokens: int = 0) -> None:
    meta = WorkerMeta(wid, "i", Geometry(4, 8, 2), full_tokens, 1024, True, True, COSTS, host_full_tokens)
    index.resync(WorkerResync(meta, CacheSnapshot(wid, "i", 0, {})))


def _valid_event(rng: random.Random, pages: dict[int, PageState], universe: int) -> CacheEvent | None:
    """A random event the worker's tree could emit from `pages` (or None: nothing fits)."""
    if rng.random() < 0.03:
        return CacheEvent(K.CLEARED)
    kind = rng.choice([k for k in EventKind if k is not K.CLEARED])
    hashes = []
    for h in rng.sample(range(1, universe + 1), rng.randint(1, 4)):
        try:
            state_after(kind, pages.get(h), h)
        except ValueError:
            continue
        hashes.append(h)
    return CacheEvent(kind, tuple(hashes)) if hashes else None


def _check_bits(index: ClusterIndex) -> None:
    """Every PageMap entry is exactly the indexed states of its page (cluster/page_map.py)."""
    want: dict[int, list[int]] = {}
    for e in index.workers():
        for h, s in e.pages.items():
            bits = want.setdefault(h, [0, 0, 0, 0])
            bits[PRESENT] |= e.bit
            bits[TOMB] |= e.bit if not s.has_swa else 0
            bits[HOST_FULL] |= e.bit if s.full_on_host else 0
            bits[HOST_SWA] |= e.bit if s.swa_on_host else 0
    assert {h: index.page_map.get(h) for h in want} == want and len(index.page_map) == len(want)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(5, 60))
def test_random_streams_replay_per_worker(seed: int, workers: int, steps: int) -> None:
    """Interleaved random valid streams of every kind (offload, load, SWA moves, tombstones,
    revivals, removals, clears): each worker's indexed states equal `replay` of its events, the
    bitsets agree, and a resync from the index's snapshot rebuilds the same index."""
    rng = random.Random(seed)
    index = ClusterIndex()
    truth: dict[str, dict[int, PageState]] = {}
    seqs: dict[str, int] = {}
    for w in range(workers):
        _register(index, f"w{w}")
        truth[f"w{w}"], seqs[f"w{w}"] = {}, 0
    for _ in range(steps):
        wid = f"w{rng.randrange(workers)}"
        events = []
        for _ in range(3):  # each event's validity depends on the ones before it
            ev = _valid_event(rng, truth[wid], 12)
            if ev is not None:
                replay([ev], truth[wid])
                events.append(ev)
        if not events:
            continue
        seqs[wid] += 1
        assert index.apply(EventBatch(wid, "i", seqs[wid], tuple(events))) is ApplyOutcome.APPLIED
        snap = index.snapshot(wid)
        assert snap is not None and snap.pages == truth[wid]
        _check_bits(index)
    copy = ClusterIndex()
    for update in index.resyncs():
        copy.apply_update(update)
    for wid in truth:
        assert copy.snapshot(wid) == index.snapshot(wid)
    _check_bits(copy)


def test_a_contradicting_event_asks_for_a_resync() -> None:
    """SWA_LOADED of a LIVE page, or STORED of a present one: no tree emits that, so the
    worker's entry is cleared (never a stale positive) and it must resync."""
    for bad in (CacheEvent(K.SWA_LOADED, (1,)), CacheEvent(K.STORED, (1,)), CacheEvent(K.LOADED, (1,))):
        index = ClusterIndex()
        _register(index, "w")
        index.apply(EventBatch("w", "i", 1, (CacheEvent(K.STORED, (1, 2)),)))
        outcome = index.apply(EventBatch("w", "i", 2, (bad,)))
        assert outcome is ApplyOutcome.OUT_OF_SYNC and outcome.resync_needed and outcome.changed
        assert index.worker("w").stale and index.page_map.get(1) is None and index.page_map.get(2) is None


def test_tier_moves_of_pages_the_bound_evicted_stay_absent() -> None:
    """Offload / load / SWA moves of a page the memory bound dropped do not re-add it."""
    index = ClusterIndex(IndexLimits(max_pages_per_worker=1))
    _register(index, "w")
    index.apply(EventBatch("w", "i", 1, (CacheEvent(K.STORED, (1, 2)),)))  # 2 is dropped
    moves = (CacheEvent(K.OFFLOADED, (2, 1)), CacheEvent(K.LOADED, (2,)), CacheEvent(K.SWA_REMOVED, (2,)))
    assert index.apply(EventBatch("w", "i", 2, moves)) is ApplyOutcome.APPLIED
    assert index.snapshot("w").pages == {1: PageState.HOST}


def test_the_host_tier_counts_in_the_page_cap() -> None:
    """A worker holds pages in both tiers: its cap is its device and host full capacity."""
    index = ClusterIndex()
    _register(index, "w", full_tokens=8, host_full_tokens=8)  # 2 + 2 pages of 4 tokens
    index.apply(EventBatch("w", "i", 1, (CacheEvent(K.STORED, (1, 2, 3, 4, 5)),)))
    assert len(index.snapshot("w").pages) == 4
