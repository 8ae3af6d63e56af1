"""`bench.index_actor` at its smallest, through a real local Ray cluster: every push is made,
every router ends holding the replay of the streams, and the figures are counted from them.

No timed assertion: rates and CPU are reported, never compared to a bound here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.event_streams import FleetStream, make_stream
from bench.index_actor import _digest, add_arguments, expected_digests, run
from core.events import PageState

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_the_replay_digest_sees_one_changed_page() -> None:
    """The consistency check can fail: a router missing a page, or holding it as a tombstone."""
    stream = make_stream(FleetStream(workers=2, rate=4_000.0, step_ms=20.0, cache_pages=64, request_pages=8,
                                     shared_prompts=2), 0.2)  # fmt: skip
    want = expected_digests(stream)
    first = stream.resyncs[0]
    assert first.snapshot is not None
    pages = dict(first.snapshot.pages)
    assert _digest(pages) != want[first.meta.worker_id]  # the batches changed it
    page = next(iter(pages))
    assert _digest(pages) != _digest({**pages, page: PageState.TOMBSTONE})
    assert _digest(pages) != _digest({p: s for p, s in pages.items() if p != page})


def test_the_command_plays_every_push_and_every_router_holds_the_replay(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workers", "3", "--rate", "4000", "--cache-pages", "64", "--step-ms", "50",
                              "--duration", "0.5", "--fleets", "2", "--routers", "2", "--num-cpus", "1",
                              "--output-dir", str(tmp_path)])  # fmt: skip
    assert run(args) == 0  # 1 when a figure is not consistent
    (figures,) = json.loads((tmp_path / "index_actor.json").read_text())["figures"]
    assert figures["consistent"] and figures["workers"] == 3 and figures["routers"] == 2
    assert figures["offered_pushes_per_s"] == pytest.approx(3 * 1000 / 50)
    assert figures["pushes_per_s"] > 0 and figures["deltas_per_s"] > 0 and figures["actor_us_per_message"] > 0
    assert "| 3 | 2 |" in (tmp_path / "index_actor.md").read_text()
