"""Pending pages (router/pending.py) and stale-sample credits (router/inflight.py) through
RouterCore, with no events and no clock but the one passed in."""

from __future__ import annotations

from routing_builders import PAGE, WINDOW, index_with, load, prompt

from cluster.index import ClusterIndex
from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerRemoved, WorkerResync
from core.events import CacheEvent, EventKind, page_hashes
from core.geometry import Geometry
from router.core import Candidate, RouterCore
from router.inflight import InflightTracker
from router.pending import PendingPages
from router.policies import make_policy


def _core(index: ClusterIndex, ttl_s: float = 10.0) -> RouterCore:
    return RouterCore(index, make_policy("swa_prefix"), pending=PendingPages(ttl_s=ttl_s))


def _cands(*wids: str) -> list[Candidate]:
    return [Candidate(w) for w in wids]


def _placed_on(core: RouterCore, tokens: list[int], key: str, now: float = 1.0) -> str:
    best = core.decide(tokens, _cands("a", "b"), request_key=key, now=now).best
    assert best is not None
    return best.worker_id


def test_a_placement_is_credited_at_once() -> None:
    """While the first request still runs, the next decision for its prompt already predicts
    every page of it on that worker, before any cache event; with both workers equally busy it
    goes there."""
    core = _core(index_with(prompt(6), {"a": "", "b": ""}))
    for i in range(4):  # whichever worker the tie picks, the repeat follows it
        tokens = prompt(6, base=5000 * (i + 1))
        first = _placed_on(core, tokens, f"r{i}")
        other = "b" if first == "a" else "a"
        busy = prompt(6, base=99_000 + 100 * i)  # as much in flight on the other worker
        core.decide(busy, _cands(other), request_key=f"busy{i}", now=1.0)
        again = core.decide(tokens, _cands("a", "b"), now=1.5)
        assert again.best is not None and again.best.worker_id == first
        assert again.predicted_for(first) == 6 * PAGE and again.predicted_for(other) == 0
    assert len(core.pending) == 8


def test_pending_pages_are_live_past_the_valid_match() -> None:
    """Pages past the worker's valid match will be recomputed LIVE (tombstones revived); the
    ones it reuses keep their state."""
    tokens = prompt(6)
    core = _core(index_with(tokens, {"a": "LLLLTT", "b": "......"}))
    assert core.match(tokens, ["a"])["a"].p_valid == 4 * PAGE
    assert _placed_on(core, tokens, "r1") == "a"
    assert core.decide(tokens, _cands("a", "b"), now=1.1).predicted_for("a") == 6 * PAGE
    # a branch inside the reused part still sees the index's tombstones there
    core2 = _core(index_with(tokens, {"a": "TLLL..", "b": "......"}))
    core2.decide(tokens, _cands("a"), request_key="r1", now=1.0)
    branch = tokens[: 3 * PAGE] + [1, 2, 3, 4, 5]
    assert core2.match(branch, ["a"])["a"].p_valid == 3 * PAGE  # window 8 = 2 LIVE pages after T


def test_completion_hands_back_to_the_index() -> None:
    """Once the request completed, the index is the truth: here it never got the pages."""
    tokens = prompt(5)
    core = _core(index_with(tokens, {"a": "", "b": ""}))
    worker = _placed_on(core, tokens, "r1")
    core.complete("r1", now=2.0)
    assert core.decide(tokens, _cands("a", "b"), now=2.1).predicted_for(worker) == 0
    assert len(core.pending) == 0


def test_events_confirm_then_correct() -> None:
    """When the index holds every pending page the record ends; later events (a tombstone)
    then count, not the prediction."""
    tokens = prompt(4)
    index = index_with(tokens, {"a": "", "b": ""})
    core = _core(index)
    worker = _placed_on(core, tokens, "r1")
    chain = page_hashes(tokens, PAGE)
    index.apply(EventBatch(worker, "inc", 1, (CacheEvent(EventKind.STORED, tuple(chain)),)))
    assert core.decide(tokens, _cands("a", "b"), now=1.1).predicted_for(worker) == 4 * PAGE
    assert len(core.pending) == 0 and core.pending.confirmed == 1
    index.apply(EventBatch(worker, "inc", 2, (CacheEvent(EventKind.SWA_REMOVED, (chain[2],)),)))
    assert core.decide(tokens, _cands("a", "b"), now=1.2).predicted_for(worker) == 2 * PAGE


def test_unconfirmed_records_expire() -> None:
    """No event and no completion: the record ends after ttl_s."""
    tokens = prompt(4)
    core = _core(index_with(tokens, {"a": "", "b": ""}), ttl_s=5.0)
    worker = _placed_on(core, tokens, "r1", now=1.0)
    assert core.decide(tokens, _cands("a", "b"), now=5.9).predicted_for(worker) == 4 * PAGE
    assert core.decide(tokens, _cands("a", "b"), now=6.1).predicted_for(worker) == 0
    assert len(core.pending) == 0


def test_a_worker_that_left_or_restarted_keeps_nothing() -> None:
    """Removed from the index (its bit may go to another worker) or a new incarnation: its
    pending pages go with it."""
    tokens = prompt(4)
    index = index_with(tokens, {"a": "", "b": ""})
    core = _core(index)
    worker = _placed_on(core, tokens, "r1")
    index.apply_update(WorkerRemoved(worker))
    meta = WorkerMeta("c", "inc", Geometry(PAGE, WINDOW), 1 << 16, 1 << 14, hybrid=True)
    index.resync(WorkerResync(meta, CacheSnapshot("c", "inc", 0, {})))  # takes the freed bit
    assert core.decide(tokens, _cands("a", "b", "c"), now=1.1).predicted_for("c") == 0
    assert len(core.pending) == 0
    worker = _placed_on(core, tokens, "r2")
    meta = WorkerMeta(worker, "inc2", Geometry(PAGE, WINDOW), 1 << 16, 1 << 14, hybrid=True)
    index.resync(WorkerResync(meta, CacheSnapshot(worker, "inc2", 0, {})))
    assert core.decide(tokens, _cands("a", "b"), now=1.2).predicted_for(worker) == 0


def test_records_follow_the_replica_serve_chose() -> None:
    """When Serve sent the request to a lower rank, its pages and load move there."""
    tokens = prompt(4)
    core = _core(index_with(tokens, {"a": "", "b": ""}))
    first = _placed_on(core, tokens, "r1")
    other = "b" if first == "a" else "a"
    core.placed("r1", tokens, other, now=1.0)
    decision = core.decide(tokens, _cands("a", "b"), now=1.1)
    assert decision.predicted_for(other) == 4 * PAGE and decision.predicted_for(first) == 0
    assert core.inflight.unsampled(other, None) == (len(tokens), 1)
    assert core.inflight.unsampled(first, None) == (0, 0)


def test_avoided_workers_rank_last() -> None:
    """A retry that avoids the worker with the cache goes to the other one."""
    tokens = prompt(4)
    core = _core(index_with(tokens, {"a": "LLLL", "b": ""}))
    decision = core.decide(tokens, _cands("a", "b"), avoid=("a",), now=1.0)
    assert [r.worker_id for r in decision.ranked] == ["b", "a"]


def test_a_stale_sample_does_not_rank_the_cache_away() -> None:
    """A sample taken while the first request ran still counts it; once the router saw it
    complete, its load is taken back, so the repeat goes to the worker holding its pages."""
    tokens = prompt(50)
    index = index_with(tokens, {"a": "L" * 50, "b": ""})
    core = _core(index)
    core.inflight.record("r1", "a", len(tokens), at=1.0)
    core.complete("r1", now=3.0)
    stale = [
        Candidate("a", load("a", queued=len(tokens), at=2.0)),
        Candidate("b", load("b", at=2.0)),
    ]
    for i in range(3):  # no tie rotation can hand it to b
        assert core.decide(tokens, stale, now=3.5 + i).best.worker_id == "a"  # type: ignore[union-attr]
    assert core.inflight.unsampled("a", 2.0) == (-len(tokens), -1)
    assert core.inflight.unsampled("a", 3.2) == (0, 0)  # that sample no longer holds it


def test_credits_only_for_requests_the_sample_holds() -> None:
    """Placed and completed between two samples: no credit, no extra; in the sample and
    completed after it: a credit until a sample after the completion."""
    t = InflightTracker()
    t.record("in", "a", 100, at=1.0)
    t.record("between", "a", 40, at=2.5)
    assert t.unsampled("a", 2.0) == (40, 1)  # "in" is in the sample, "between" is not
    t.complete("between", at=2.8)
    t.complete("in", at=3.0)
    assert t.unsampled("a", 2.0) == (-100, -1)
    assert t.unsampled("a", 2.9) == (-100, -1)  # holds "in"; "between" ended before it
    assert t.unsampled("a", 3.1) == (0, 0)
