"""ClusterIndex: event application, sequence gaps, resync, incarnations, removal, memory bound."""

from __future__ import annotations

from cluster.index import ApplyOutcome, ClusterIndex, IndexLimits
from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerRemoved, WorkerResync
from core.events import CacheEvent, EventKind, PageState
from core.geometry import Geometry

K = EventKind


def _meta(wid: str = "w0", inc: str = "i0", full_tokens: int = 1 << 16) -> WorkerMeta:
    return WorkerMeta(
        wid, inc, geometry=Geometry(4, 8), full_tokens=full_tokens, swa_tokens=1024, hybrid=True
    )


def _fresh(index: ClusterIndex, wid: str = "w0", inc: str = "i0", **kw: int) -> WorkerMeta:
    meta = _meta(wid, inc, **kw)
    index.resync(WorkerResync(meta, CacheSnapshot(wid, inc, 0, {})))
    return meta


def _batch(
    seq: int, *events: tuple[EventKind, tuple[int, ...]], wid: str = "w0", inc: str = "i0"
) -> EventBatch:
    return EventBatch(wid, inc, seq, tuple(CacheEvent(k, h) for k, h in events))


def _states(index: ClusterIndex, wid: str = "w0") -> dict[int, PageState]:
    snap = index.snapshot(wid)
    assert snap is not None
    return dict(snap.pages)


def test_events_set_page_states() -> None:
    """STORED/STORED_FULL_ONLY/SWA_REMOVED/SWA_RESTORED/REMOVED move pages between states."""
    index = ClusterIndex()
    _fresh(index)
    assert (
        index.apply(_batch(1, (K.STORED, (1, 2, 3)), (K.STORED_FULL_ONLY, (4,))))
        is ApplyOutcome.APPLIED
    )
    assert index.apply(
        _batch(2, (K.SWA_REMOVED, (1,)), (K.SWA_RESTORED, (4,)), (K.REMOVED, (3,)))
    ).changed
    assert _states(index) == {1: PageState.TOMBSTONE, 2: PageState.LIVE, 4: PageState.LIVE}
    bit = index.worker("w0").bit
    assert index.page_map.get(1) == [bit, bit, 0, 0]  # present and tombstone
    assert index.page_map.get(3) is None


def test_cleared_empties_the_worker() -> None:
    """CLEARED drops every page of that worker and only that worker."""
    index = ClusterIndex()
    _fresh(index, "a")
    _fresh(index, "b")
    index.apply(_batch(1, (K.STORED, (1, 2)), wid="a"))
    index.apply(_batch(1, (K.STORED, (1,)), wid="b"))
    index.apply(_batch(2, (K.CLEARED, ()), wid="a"))
    assert _states(index, "a") == {}
    assert index.page_map.get(1) == [index.worker("b").bit, 0, 0, 0]
    assert index.page_map.get(2) is None


def test_duplicate_batch_is_ignored() -> None:
    """A batch at or below the applied seq changes nothing."""
    index = ClusterIndex()
    _fresh(index)
    index.apply(_batch(1, (K.STORED, (1,))))
    assert index.apply(_batch(1, (K.REMOVED, (1,)))) is ApplyOutcome.DUPLICATE
    assert _states(index) == {1: PageState.LIVE}


def test_gap_marks_stale_until_resync() -> None:
    """A skipped seq clears the entry (match 0), later batches are ignored, a snapshot restores."""
    index = ClusterIndex()
    meta = _fresh(index)
    index.apply(_batch(1, (K.STORED, (1, 2))))
    gap = index.apply(_batch(3, (K.STORED, (3,))))
    assert gap is ApplyOutcome.GAP and gap.resync_needed
    assert index.worker("w0").stale and index.snapshot("w0") is None
    assert index.page_map.get(1) is None  # never a stale positive
    assert index.apply(_batch(4, (K.STORED, (4,)))) is ApplyOutcome.STALE
    snap = CacheSnapshot("w0", "i0", 4, {1: PageState.LIVE, 4: PageState.TOMBSTONE})
    assert index.resync(WorkerResync(meta, snap)) is ApplyOutcome.RESYNCED
    assert (
        index.apply(_batch(4, (K.REMOVED, (1,)))) is ApplyOutcome.DUPLICATE
    )  # inside the snapshot
    assert index.apply(_batch(5, (K.STORED, (5,)))) is ApplyOutcome.APPLIED
    assert _states(index) == {1: PageState.LIVE, 4: PageState.TOMBSTONE, 5: PageState.LIVE}


def test_new_incarnation_drops_old_pages() -> None:
    """A batch from a restarted replica removes the old incarnation's pages and asks for a resync."""
    index = ClusterIndex()
    _fresh(index)
    index.apply(_batch(1, (K.STORED, (1, 2))))
    outcome = index.apply(_batch(1, (K.STORED, (9,)), inc="i1"))
    assert outcome is ApplyOutcome.NEW_INCARNATION and outcome.resync_needed
    assert index.worker("w0") is None and index.page_map.get(1) is None
    _fresh(index, inc="i1")
    assert index.apply(_batch(1, (K.STORED, (9,)), inc="i1")) is ApplyOutcome.APPLIED
    assert _states(index) == {9: PageState.LIVE}


def test_resync_with_new_incarnation_starts_clean() -> None:
    """Registering a new incarnation replaces the old pages with the (empty) fresh state."""
    index = ClusterIndex()
    _fresh(index)
    index.apply(_batch(1, (K.STORED, (1,))))
    _fresh(index, inc="i1")
    assert _states(index) == {} and index.worker("w0").seq == 0


def test_unknown_worker_needs_resync() -> None:
    """A batch from a worker the index never saw is not applied."""
    index = ClusterIndex()
    outcome = index.apply(_batch(1, (K.STORED, (1,))))
    assert outcome is ApplyOutcome.UNKNOWN_WORKER and outcome.resync_needed and not outcome.changed


def test_resync_without_snapshot_is_stale() -> None:
    """WorkerResync(meta, None) registers the worker as stale."""
    index = ClusterIndex()
    assert index.resync(WorkerResync(_meta(), None)) is ApplyOutcome.STALE
    assert index.worker("w0").stale


def test_remove_frees_bit_and_pages() -> None:
    """Removal drops pages from the page map; the freed bit is reused by the next worker."""
    index = ClusterIndex()
    _fresh(index, "a")
    index.apply(_batch(1, (K.STORED, (1,)), wid="a"))
    bit = index.worker("a").bit
    assert index.apply_update(WorkerRemoved("a", "other")) is ApplyOutcome.DUPLICATE
    assert index.apply_update(WorkerRemoved("a")) is ApplyOutcome.REMOVED
    assert index.page_map.get(1) is None and len(index) == 0
    _fresh(index, "b")
    assert index.worker("b").bit == bit


def test_memory_bound_evicts_leaf_side_first() -> None:
    """Over the per-worker bound, the deepest pages of the oldest chain go first."""
    index = ClusterIndex(IndexLimits(max_pages_per_worker=4))
    _fresh(index)
    index.apply(_batch(1, (K.STORED, (1, 2, 3))))
    index.apply(_batch(2, (K.STORED, (7, 8))))
    assert set(_states(index)) == {1, 2, 7, 8}
    assert index.worker("w0").evicted_pages == 1
    assert index.page_map.get(3) is None


def test_pool_size_caps_pages() -> None:
    """A worker never holds more pages than its full pool has."""
    index = ClusterIndex()
    _fresh(index, full_tokens=8)  # 2 pages of 4 tokens
    index.apply(_batch(1, (K.STORED, (1, 2, 3))))
    assert len(_states(index)) == 2


def test_swa_events_on_evicted_pages_stay_absent() -> None:
    """SWA_REMOVED/RESTORED for a page the index evicted do not re-add it (conservative)."""
    index = ClusterIndex(IndexLimits(max_pages_per_worker=1))
    _fresh(index)
    index.apply(_batch(1, (K.STORED, (1, 2))))
    index.apply(_batch(2, (K.SWA_REMOVED, (2,)), (K.SWA_RESTORED, (2,))))
    assert set(_states(index)) == {1}


def test_max_workers_drops_oldest() -> None:
    """The worker bound removes the oldest-registered worker."""
    index = ClusterIndex(IndexLimits(max_workers=2))
    for wid in "abc":
        _fresh(index, wid)
    assert [e.meta.worker_id for e in index.workers()] == ["b", "c"]


def test_resyncs_rebuild_an_identical_index() -> None:
    """Replaying `resyncs()` into a new index reproduces every worker's pages and staleness."""
    index = ClusterIndex()
    _fresh(index, "a")
    _fresh(index, "b")
    index.apply(_batch(1, (K.STORED, (1, 2)), (K.SWA_REMOVED, (1,)), wid="a"))
    index.apply(_batch(2, (K.STORED, (3,)), wid="b"))  # gap: b stale
    copy = ClusterIndex()
    for update in index.resyncs():
        copy.apply_update(update)
    assert copy.snapshot("a") == index.snapshot("a")
    assert copy.worker("b").stale
