"""The router's mirror is exact: fed the real radix cache's events, its valid and full matches
equal the cache's own `match_prefix` for every probe, after every insert, SWA free and eviction,
and its (reused, repaired) prediction is the worker's own repair decision (core/reuse.py). The
prompts come under three root hashes (no cache salt, two salts: docs/design.md §9.10), so a
prediction that counted another salt's prefix would differ from the cache's match."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.index import ClusterIndex
from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerResync
from core.events import ROOT_HASH, salted_root
from core.geometry import Geometry
from core.reuse import plan_reuse
from router.core import Candidate, RouterCore
from router.policies import make_policy
from worker.cache.radix_cache import RadixCache
from worker.kv.hybrid_allocator import HybridAllocator

PAGE = 2
SWA_LAYERS = 2
ROOTS = (ROOT_HASH, salted_root("tenant-a"), salted_root("tenant-b"))


class MirroredWorker:
    """A real radix cache whose drained events feed a ClusterIndex, as the transport would."""

    def __init__(self, window: int) -> None:
        self.cache = RadixCache(HybridAllocator(256, 96, PAGE, True), Geometry(PAGE, window))
        self.index = ClusterIndex()
        meta = WorkerMeta("w", "i", Geometry(PAGE, window, SWA_LAYERS), full_tokens=256, swa_tokens=96,
                          hybrid=True, tombstone_repair=True)  # fmt: skip
        self.index.resync(WorkerResync(meta, CacheSnapshot("w", "i", 0, {})))
        self.core = RouterCore(self.index, make_policy())
        self.seq = 0

    def insert(self, tokens: list[int], evicted: int, root: int = ROOT_HASH) -> None:
        slots = self._alloc(len(tokens))
        if slots is None:
            return
        if evicted:
            self.cache.allocator.free_swa(slots[:evicted])
        self.cache.insert(tokens, slots, swa_evicted_seqlen=evicted, root_hash=root)
        self.sync()

    def evict(self, full: int, swa: int) -> None:
        self.cache.evict(full, swa)
        self.sync()

    def flush(self) -> None:
        self.cache.reset()  # no locks held: one CLEARED event
        self.sync()

    def sync(self) -> None:
        events = self.cache.drain_events()
        self.seq += 1
        assert self.index.apply(EventBatch("w", "i", self.seq, tuple(events))).changed

    def predicted(self, prompt: list[int], root: int = ROOT_HASH) -> tuple[int, int, int, int]:
        """(valid, full) matches, then the decision's (cached, repaired) prediction."""
        match = self.core.match(prompt, ["w"], root).get("w")
        valid, full = (0, 0) if match is None else (match.p_valid, match.p_full)
        best = self.core.decide(prompt, [Candidate("w")], root_hash=root).best
        assert best is not None
        return valid, full, best.predicted_cached_tokens, best.predicted_repaired_tokens

    def actual(self, prompt: list[int], root: int = ROOT_HASH) -> tuple[int, int, int, int]:
        m = self.cache.match_prefix(prompt[:-1], root)
        reuse = plan_reuse(m.full_length, m.length, Geometry(PAGE, self.cache.window, SWA_LAYERS), repair=True)
        return m.length, m.full_length, reuse.reused, reuse.repaired

    def _alloc(self, n: int) -> torch.Tensor | None:
        slots = self.cache.allocator.alloc(n)
        if slots is None:
            self.cache.evict(n, n)
            slots = self.cache.allocator.alloc(n)
        return slots


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts in a few families sharing heads, so prefixes and branches overlap."""
    heads = [[rng.randrange(4) for _ in range(rng.randrange(2, 12))] for _ in range(3)]
    return [
        rng.choice(heads) + [rng.randrange(4) for _ in range(rng.randrange(0, 14))]
        for _ in range(n)
    ]


@pytest.mark.parametrize("window", [3, 4])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(5, 25))
def test_prediction_equals_cache_match(window: int, seed: int, steps: int) -> None:
    """Random inserts (SWA frontiers → tombstones, revivals), evictions and flushes; every
    probe's prediction equals the cache's own match."""
    rng = random.Random(seed)
    worker = MirroredWorker(window)
    prompts = _prompts(rng, 12)
    for _ in range(steps):
        if rng.random() < 0.7:
            tokens = rng.choice(prompts)
            aligned = tokens[: len(tokens) - len(tokens) % PAGE]
            if aligned:
                frontier = rng.randrange(0, len(aligned) + 1, PAGE)
                worker.insert(aligned, frontier, rng.choice(ROOTS))
        elif rng.random() < 0.9:
            worker.evict(rng.randrange(0, 24, PAGE), rng.randrange(0, 24, PAGE))
        else:
            worker.flush()
        for probe in prompts:
            for root in ROOTS:
                assert worker.predicted(probe, root) == worker.actual(probe, root), (probe, root)
    worker.cache.check_integrity()
