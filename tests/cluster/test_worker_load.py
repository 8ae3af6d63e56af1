"""Routing-stats contract: what a worker reports parses back; bad reports name the key."""

from __future__ import annotations

import pytest

from cluster.messages import (
    STAT_QUEUE_LEN,
    STAT_SWA_FREE_TOKENS,
    PoolHeadroom,
    WorkerLoad,
    make_routing_stats,
)


def _stats() -> dict:
    return make_routing_stats(
        worker_id="w",
        timestamp_s=12.5,
        queue_len=3,
        queued_prefill_tokens=900,
        running_decodes=7,
        full=PoolHeadroom(100, 50, 1000),
        swa=PoolHeadroom(10, 5, 800),
    )


def test_round_trip() -> None:
    """make_routing_stats → from_routing_stats keeps every number."""
    load = WorkerLoad.from_routing_stats(_stats())
    assert load == WorkerLoad(
        "w", 12.5, 3, 900, 7, PoolHeadroom(100, 50, 1000), PoolHeadroom(10, 5, 800)
    )
    assert load.full.allocatable == 150


def test_no_report_yet_is_none() -> None:
    """A replica that has not reported yet has no load (an empty dict)."""
    assert WorkerLoad.from_routing_stats({}) is None and WorkerLoad.from_routing_stats(None) is None


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        (STAT_QUEUE_LEN, -1, ">= 0"),
        (STAT_SWA_FREE_TOKENS, "x", "number"),
        (STAT_QUEUE_LEN, True, "number"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, match: str) -> None:
    """Negative or non-numeric values are rejected with the key in the message."""
    stats = _stats() | {key: value}
    with pytest.raises(ValueError, match=f"{key}.*{match}"):
        WorkerLoad.from_routing_stats(stats)


def test_missing_key_named() -> None:
    """A missing key is listed, with the builder to use."""
    stats = _stats()
    del stats[STAT_QUEUE_LEN]
    with pytest.raises(ValueError, match="queue_len.*make_routing_stats"):
        WorkerLoad.from_routing_stats(stats)
