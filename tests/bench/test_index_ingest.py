"""`bench.index_ingest` at its smallest: what it reports is consistent with what it sent.

No timed assertion: the rates are reported, never compared to a bound here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.event_streams import FleetStream, make_stream
from bench.index_ingest import (
    IngestSettings,
    add_arguments,
    equal_replay,
    measure,
    measure_unpaced,
    run,
)
from cluster.index import ClusterIndex
from cluster.messages import WorkerResync
from core.events import EventKind

SMALL = FleetStream(workers=2, rate=4_000.0, step_ms=20.0, cache_pages=64, request_pages=8, shared_prompts=2)


def test_the_stream_is_steady_state_and_every_event_is_one_a_tree_makes() -> None:
    """Each worker stores about rate × time / P pages, keeps its cache at its size, and the
    index applies every batch (a replay from the snapshots gives the same pages)."""
    stream = make_stream(SMALL, 0.5)
    stored = sum(len(e.page_hashes) for _, b, _ in stream.batches for e in b.events if e.kind is EventKind.STORED)
    per_worker = SMALL.rate * 0.5 / SMALL.page_size
    assert abs(stored - SMALL.workers * per_worker) <= SMALL.workers * SMALL.request_pages
    kinds = {e.kind for _, b, _ in stream.batches for e in b.events}
    assert kinds == {EventKind.STORED, EventKind.SWA_REMOVED, EventKind.REMOVED}
    index = ClusterIndex()
    for r in stream.resyncs:
        index.resync(r)
    for _, batch, _ in stream.batches:
        assert index.apply(batch).changed
    assert equal_replay(stream, index)
    assert all(len(e.pages) == SMALL.cache_pages for e in index.workers())


def test_events_applied_equal_events_sent_and_both_indexes_equal_the_replay() -> None:
    stream = make_stream(SMALL, 0.5)
    hub_rate, router_rate, applied, consistent = measure_unpaced(stream, 0.01)
    assert applied == stream.page_events > 0
    assert consistent and hub_rate > 0 and router_rate > 0


def test_a_changed_page_breaks_the_replay_check() -> None:
    """The consistency check can fail: an index missing one page is not the replay."""
    stream = make_stream(SMALL, 0.2)
    index = ClusterIndex()
    for r in stream.resyncs:
        index.resync(r)
    for _, batch, _ in stream.batches:
        index.apply(batch)
    first = stream.resyncs[0]
    assert first.snapshot is not None
    pages = dict(index.snapshot(first.meta.worker_id).pages)  # type: ignore[union-attr]
    pages.pop(next(iter(pages)))
    index.resync(WorkerResync(first.meta, type(first.snapshot)(first.meta.worker_id, "i", 0, pages)))
    assert not equal_replay(stream, index)


def test_the_smallest_configuration_reports_consistent_figures() -> None:
    figures = measure(IngestSettings(SMALL, stream_s=0.3, duration_s=0.3, decisions=50.0))
    assert figures.consistent and figures.applied == figures.events > 0
    assert figures.workers == SMALL.workers and figures.decisions > 0
    assert figures.produced_per_s > 0 and figures.behind >= 0


def test_the_command_writes_its_table(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workers", "2", "--rate", "4000", "--cache-pages", "64", "--stream-s", "0.2",
                              "--duration", "0.2", "--decisions", "20", "--output-dir", str(tmp_path)])  # fmt: skip
    assert run(args) == 0
    text = (tmp_path / "index_ingest.md").read_text()
    assert "| 2 |" in text and (tmp_path / "index_ingest.json").exists()
