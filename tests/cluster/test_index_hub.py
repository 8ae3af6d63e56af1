"""IndexHub (the index actor's logic without Ray): acks, the bounded log, router replay."""

from __future__ import annotations

from cluster.index import ClusterIndex
from cluster.index_hub import IndexHub, apply_delta
from cluster.messages import CacheSnapshot, EventBatch, WorkerMeta, WorkerRemoved, WorkerResync
from core.events import CacheEvent, EventKind
from core.geometry import Geometry


def _meta(wid: str = "w", inc: str = "i") -> WorkerMeta:
    return WorkerMeta(
        wid, inc, geometry=Geometry(4, 8), full_tokens=4096, swa_tokens=1024, hybrid=True
    )


def _register(hub: IndexHub, wid: str = "w", inc: str = "i") -> None:
    hub.resync(WorkerResync(_meta(wid, inc), CacheSnapshot(wid, inc, 0, {})))


def _stored(seq: int, *hashes: int, wid: str = "w", inc: str = "i") -> EventBatch:
    return EventBatch(wid, inc, seq, (CacheEvent(EventKind.STORED, hashes),))


def _replayed(
    hub: IndexHub, index: ClusterIndex, epoch: str | None, cursor: int
) -> tuple[str, int]:
    delta = hub.pull(epoch, cursor)
    if delta is None:
        return epoch or "", cursor
    apply_delta(index, delta)
    return delta.epoch, delta.cursor


def test_router_copy_follows_the_hub() -> None:
    """A router replaying pulled deltas holds the same pages as the hub."""
    hub, local = IndexHub(), ClusterIndex()
    _register(hub)
    epoch, cursor = _replayed(hub, local, None, 0)
    assert not hub.push(_stored(1, 10, 11)).resync_needed
    hub.push(_stored(2, 12))
    assert hub.pull(epoch, cursor).since == cursor
    epoch, cursor = _replayed(hub, local, epoch, cursor)
    assert local.snapshot("w") == hub.index.snapshot("w")
    assert hub.pull(epoch, cursor) is None


def test_gap_asks_worker_for_snapshot_and_routers_go_stale() -> None:
    """A gap answers resync_needed; the logged gap makes routers stale too; the snapshot heals."""
    hub, local = IndexHub(), ClusterIndex()
    _register(hub)
    hub.push(_stored(1, 10))
    assert hub.push(_stored(3, 12)).resync_needed
    epoch, cursor = _replayed(hub, local, None, 0)
    assert local.worker("w").stale
    assert hub.push(_stored(4, 13)).resync_needed  # still waiting for the snapshot
    hub.resync(WorkerResync(_meta(), CacheSnapshot("w", "i", 4, {})))
    hub.push(_stored(5, 14))
    _replayed(hub, local, epoch, cursor)
    assert not local.worker("w").stale and set(local.snapshot("w").pages) == {14}


def test_duplicates_are_not_logged() -> None:
    """Ignored batches do not grow the log."""
    hub = IndexHub()
    _register(hub)
    hub.push(_stored(1, 10))
    end = hub.end
    hub.push(_stored(1, 10))
    assert hub.end == end


def test_lagging_router_gets_a_reset() -> None:
    """A cursor older than the bounded log, or another epoch, rebuilds from per-worker resyncs."""
    hub, local = IndexHub(max_log=2), ClusterIndex()
    _register(hub)
    for seq in range(1, 5):
        hub.push(_stored(seq, 100 + seq))
    delta = hub.pull(hub.epoch, 0)
    assert delta.reset and len(delta.updates) == 1
    apply_delta(local, delta)
    assert local.snapshot("w") == hub.index.snapshot("w")
    assert hub.pull("an-older-epoch", hub.end).reset


def test_removal_is_replayed() -> None:
    """A removed worker disappears from router copies; removing twice logs once."""
    hub, local = IndexHub(), ClusterIndex()
    _register(hub)
    hub.push(_stored(1, 10))
    epoch, cursor = _replayed(hub, local, None, 0)
    assert hub.remove(WorkerRemoved("w", "i")) and not hub.remove(WorkerRemoved("w", "i"))
    _replayed(hub, local, epoch, cursor)
    assert local.worker("w") is None and local.page_map.get(10) is None
