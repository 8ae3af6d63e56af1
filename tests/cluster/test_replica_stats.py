"""`ReplicaStatsBoard` without Ray: registration, refreshes, staleness, removal, forgetting."""

from __future__ import annotations

from cluster.replica_stats import ReplicaStatsBoard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _board() -> tuple[ReplicaStatsBoard, Clock]:
    clock = Clock()
    return ReplicaStatsBoard(clock), clock


def test_only_a_registering_report_adds_a_replica() -> None:
    """A request-path report (register=False) refreshes a known replica but never adds one."""
    board, _ = _board()
    assert not board.report("a", "i", {"timestamp_s": 1.0, "waiting": 1}, register=False)
    assert board.snapshot(3, 30) == {}
    assert board.report("a", "i", {"timestamp_s": 2.0, "waiting": 2}, register=True)
    assert board.report("a", "i", {"timestamp_s": 3.0, "waiting": 3}, register=False)
    assert board.snapshot(3, 30) == {"a": {"timestamp_s": 3.0, "waiting": 3}}


def test_an_older_sample_of_the_same_incarnation_is_ignored() -> None:
    """Reports that overtook each other in flight keep the newest sample."""
    board, _ = _board()
    board.report("a", "i", {"timestamp_s": 5.0, "waiting": 5}, register=True)
    assert not board.report("a", "i", {"timestamp_s": 4.0, "waiting": 4}, register=True)
    assert board.report("a", "new", {"timestamp_s": 1.0, "waiting": 0}, register=True)
    assert board.snapshot(3, 30)["a"] == {"timestamp_s": 1.0, "waiting": 0}


def test_silent_replicas_go_down_then_are_forgotten() -> None:
    """Silent past stale_after_s: listed as None (down); past forget_after_s: gone."""
    board, clock = _board()
    board.report("a", "i", {"timestamp_s": 1.0}, register=True)
    board.report("b", "i", {"timestamp_s": 1.0}, register=True)
    clock.now += 5
    board.report("b", "i", {"timestamp_s": 6.0}, register=True)
    assert board.snapshot(3, 30) == {"a": None, "b": {"timestamp_s": 6.0}}
    clock.now += 30
    assert board.snapshot(3, 30) == {"b": None}


def test_remove_matches_the_incarnation_when_given() -> None:
    """WorkerRemoved of another incarnation leaves the sample; None removes whatever is there."""
    board, _ = _board()
    board.report("a", "i", {"timestamp_s": 1.0}, register=True)
    assert not board.remove("a", "old")
    assert board.remove("a", "i") and board.snapshot(3, 30) == {}
    board.report("a", "j", {"timestamp_s": 1.0}, register=True)
    assert board.remove("a") and not board.remove("a")
